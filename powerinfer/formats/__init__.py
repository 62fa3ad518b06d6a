"""Bytes on disk, knowing no model or kernel: GGUF (`gguf`) and Hugging Face (`hf`) checkpoints
found and read (`loader`, `source`, `args`), Q4 and K-quant block codes (`q4`, `kquants`), the
sparsity bundle and converted-copy records (`bundle`), the original PowerInfer's GGUF layout
(`pwri`) and the tokenizer."""
