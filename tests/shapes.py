"""Random-model shapes shared by the tests (random_bitnet_writer's arguments)."""

# The shape of the tests that need no particular size: whole I2_S blocks, GQA, a 1000-token vocabulary.
TINY_SHAPE = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1000)
# The smallest shape worth running: one layer, two 64-wide heads sharing one KV head, 300 tokens
# (fast on SwiftShader and lavapipe; pass context_length / seed / untied as the test needs).
SMALL_SHAPE = dict(dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300)
