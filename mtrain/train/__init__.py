"""The training stage: the Trainer, LR schedules, chunked loss and run logging."""
