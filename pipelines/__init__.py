"""How an input row becomes a prompt (`prompts`), how prompts are tokenised ahead of the engine
(`feeder`), and how a completion becomes an output row (`rows`)."""
