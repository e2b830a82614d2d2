"""What a pre-training worker reads and how it makes batches of it: its share of the training shards (streams.py,
length-binned by length_binning.py), its held-out rows (heldout.py), and the dynamic masking of every batch
(masking.py)."""
