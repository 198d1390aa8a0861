"""Schedules as data: per-rank action lists (SlimPipe's, torch's, a user's), the registry of
selectable schedules and their rules, the checker and the simulator. Pure: no process group."""
