"""The special tokens' fixed ids, shared by the tokenizer (which reserves them) and the model
(padding, BOS/EOS for decoding). A module of its own so that neither imports the other."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
