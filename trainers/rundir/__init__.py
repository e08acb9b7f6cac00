"""What a run leaves on disk and reads back: workdir files, provenance, checkpoints."""
