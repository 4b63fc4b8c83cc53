"""Random-model shapes shared by the tests (random_bitnet_writer's arguments)."""

# The shape of the tests that need no particular size: whole I2_S blocks, GQA, a 1000-token vocabulary.
TINY_SHAPE = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1000)
