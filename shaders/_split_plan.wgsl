// Snippet (//#include _split_plan): how many workgroups one token's decode attention is split over, shared
// by attention.wgsl (which deals the tiles) and attention_combine.wgsl (which merges their partials), so
// both always agree. Needs TILE, SPLIT_CAP (<= MAX_SPLITS) and DIRECT_TILES; kernels/attention.py
// (`split_count`, the same rule) records a dispatch of at least this many.

// A token that sees kv_len cache rows (n_tiles = ceil(kv_len / TILE) tiles): one workgroup while they fit
// in DIRECT_TILES tiles, else one per tile up to SPLIT_CAP (ceil(n_tiles / n_splits) tiles each). It
// depends on kv_len alone: a verify row splits as its decode step.
fn split_count(kv_len: u32, n_tiles: u32) -> u32 {
    return select(min(n_tiles, SPLIT_CAP), 1u, kv_len <= DIRECT_TILES * TILE);
}
