"""Tables, figures and pages from finished runs; the entropy-bound report."""
