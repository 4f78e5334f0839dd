"""The scheduler: who runs this step, and how many tokens each."""
