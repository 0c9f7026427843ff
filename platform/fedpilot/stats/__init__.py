"""What comparisons and searches compute from recorded numbers and show: for now the labels of searched keys (keys).
Plain strings and numbers in and out, beneath compare/, report/ and tuning: it imports nothing of fedpilot."""
