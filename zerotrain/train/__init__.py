"""`zerotrain train`: train a Hugging Face causal LM from one YAML config.

The config (sections model, data, training, zero, logging, output) is read by
``zerotrain.train.config_files.load_train_config`` (the model itself is ``train/config.py``); the DeepSpeed section's "auto"
values are filled from the training settings by
``zerotrain.train.zero_fill.build_engine_config``.
"""
