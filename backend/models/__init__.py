"""Model code: checkpoint loading (loader.py), the default model, and the model implementations."""
