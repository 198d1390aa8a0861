"""Looking at schedules: recorded timelines of real steps, Perfetto traces and pictures."""
