"""Reading and writing model formats of other tools (Hugging Face Llama, Mixtral and Qwen3-MoE folders)."""
