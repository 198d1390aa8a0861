"""Which blocks each pipeline stage holds, on which rank, and the stage as a pruned module."""
