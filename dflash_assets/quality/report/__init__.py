"""What the data says, for people and the UI: the length-quality report, the answer per config, rejects, sources and the pictures."""
