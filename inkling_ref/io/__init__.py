"""Reading and writing checkpoints:

    config.py               InklingConfig and the one table of config.json keys (released and
                            transformers spellings)
    checkpoint.py           load_checkpoint, save_checkpoint, convert (the released layout)
    names.py                released tensor names <-> the reference's module names
    transformers_layout.py  transformers' save_pretrained layout <-> the released layout
"""
