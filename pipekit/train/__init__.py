"""Training: the trainer loop, data, optimizer, LR schedule, loss, metrics."""
