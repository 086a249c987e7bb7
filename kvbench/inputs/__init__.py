"""What is measured: packaged models and text, KV traces captured from them, multi-session workloads."""
