"""What a run reads and writes: checkpoint files and their check, the conditioning image,
the videos of a run, staged intermediates, the mp4/JSON report and its pictures."""
