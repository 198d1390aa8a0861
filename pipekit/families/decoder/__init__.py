"""What the built-in decoder families (Llama, Qwen3 and their MoE forms) share: args, the model
skeleton, and their Hugging Face layouts."""
