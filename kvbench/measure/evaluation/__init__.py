"""Task accuracy with compressed KV in the loop: lm-eval model classes, offline task definitions, paired statistics."""
