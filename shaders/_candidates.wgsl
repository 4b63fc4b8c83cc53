// Snippet (//#include _candidates): a screened sampled step's candidate list, written by lm_head.wgsl
// RESCORE TOPK (each rescoring workgroup reserves room with one atomicAdd on `count`, then writes its
// kept rows) and read, then emptied (count = 0), by sample_topk.wgsl CANDIDATES. Room for every row of
// the vocabulary, so no kept row is ever dropped.
struct Candidates {
    count: atomic<u32>,
    pad: u32,
    pairs: array<vec2<u32>>,  // (bitcast F16 logit, row), in no particular order
};
