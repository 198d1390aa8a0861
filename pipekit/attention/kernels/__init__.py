"""Attention kernels that return (out, lse): the CPU flash kernel, FlexAttention, their tiles
and score modifications, and the table that picks one (`backends`)."""
