"""The data path: everything between a dataset and a batch. `sampling` makes the global sample order of
(seed, epoch) and each rank's interleaved share of it, resumable mid-epoch; `stream` does the same for
iterable datasets (HF streaming, generators) without a sampler; `loaders` starts, feeds and stops a rank's
DataLoader workers; `collate` turns items into a batch (`launcher.data.collate.Pad`); `item_rng` makes
what an item draws a function of (seed, epoch, item index) alone; `text` turns files and a model folder's
tokenizer into token samples (launcher.data.text.TextDataset)."""
