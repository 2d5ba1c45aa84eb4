"""Data stage: conversations -> chat-templated tokens with assistant-only loss masks and a draft vocabulary."""
