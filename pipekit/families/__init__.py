"""The built-in model families (Llama, Llama-MoE, Qwen3, Qwen3-MoE), each one folder, found
through the `pipekit.models` entry points: the rest of pipekit never imports them, so they sit
at the top of the package's layers, as a user's own family would."""
