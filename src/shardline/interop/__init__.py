"""Reading and writing model formats of other tools (Hugging Face Llama, Mistral,
Qwen3, Mixtral and Qwen3-MoE folders)."""
