"""Running a pipeline: the sliced stage, torch's runtime fed with action lists, the extension
hooks features plug into, and the runner that feeds a batch."""
