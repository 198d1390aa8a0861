"""Memory accounting: live activation bytes of a step, by category, beside the process RSS."""
