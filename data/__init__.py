"""Data: loading, chat templates + loss masks, the built-in corpus, regeneration, feature cache."""
