"""Model definitions. Each model is one folder; pipekit itself never imports them."""
