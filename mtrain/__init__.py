"""mtrain: context-extension training with distributed dynamic sparse ring attention (MTraining)."""

__version__ = "0.1.0"
