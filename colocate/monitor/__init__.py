"""What a run reports: metrics files and the run summary, the progress bar, the W&B mirror."""
