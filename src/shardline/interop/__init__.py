"""Reading and writing model formats of other tools (Hugging Face Llama, Mistral,
Qwen2, Qwen3, Phi-3, Mixtral and Qwen3-MoE folders)."""
