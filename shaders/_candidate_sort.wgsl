// Snippet (//#include _candidate_sort): the best K of a screened step's candidate list
// (_candidates.wgsl, written by lm_head.wgsl RESCORE TOPK), the repetition penalty applied, sorted
// into sort_pairs[0 .. K) for a draw (sample_topk.wgsl FINAL CANDIDATES, spec_sample.wgsl CANDIDATES).
// The including kernel includes _topk_sort and _candidates and declares `candidates`, `params`,
// `state` (sample_topk.wgsl's layout: [2] ring length, ring from RING_AT), `keys` (the screen's
// lower-bound keys), RING_MAX and KEY_SLOTS.

//#include _order_key
//#include _radix_select

const BLOOM_WORDS: u32 = 128u;  // a 4096-bit filter of the ring's tokens (bit id % 4096)
var<workgroup> ring_wg: array<u32, RING_MAX>;
var<workgroup> ring_bloom: array<atomic<u32>, BLOOM_WORDS>;
var<workgroup> shape_wg: vec2<u32>;  // (candidates, ring entries)
var<workgroup> n_picked: atomic<u32>;
var<workgroup> picked_wg: u32;

var<private> n_ring: u32;  // ring entries the penalty looks at (sort_candidates sets it)

// Candidate i as a sort pair: (its logit after the repetition penalty, as PENALTY applies it to the
// ring's tokens; its row), or an invalid pair for a NaN logit. The bloom filter rules most rows out
// without walking the ring.
fn candidate(i: u32) -> vec2<u32> {
    let found = candidates.pairs[i];
    var value = bitcast<f32>(found.x);
    let id = found.y;
    if ((atomicLoad(&ring_bloom[(id >> 5u) % BLOOM_WORDS]) & (1u << (id & 31u))) != 0u) {
        for (var r = 0u; r < n_ring; r++) {
            if (ring_wg[r] == id) {
                value = select(value * params.penalty, value / params.penalty, value > 0.0);
                break;
            }
        }
    }
    if (value != value) {  // NaN never becomes a candidate
        return vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX);
    }
    return vec2<u32>(bitcast<u32>(value), id);
}

fn radix_key(i: u32) -> u32 {  // NaN lowest (0: no float's key)
    let pair = candidate(i);
    return select(order_key(bitcast<f32>(pair.x)), 0u, pair.y == NO_INDEX);
}

// A candidate that reaches the K-th largest key goes to the next free place of sort_pairs.
fn pick(pair: vec2<u32>, threshold: u32) {
    if (pair.y != NO_INDEX && order_key(bitcast<f32>(pair.x)) >= threshold) {
        let at = atomicAdd(&n_picked, 1u);
        if (at < N) {
            sort_pairs[at] = pair;
        }
    }
}

// All threads: sort_pairs[0 .. K) = the best K candidates after the penalty, in `before` order. The
// K-th largest key (_radix_select) picks them (with its ties) for one small sort; more than N tied
// there: the best K over chunks of the list (the first N, then N - K after the best K so far).
fn sort_candidates(lid: u32) {
    if (lid == 0u) {
        shape_wg = vec2<u32>(atomicLoad(&candidates.count), min(state[2], params.window));
        atomicStore(&n_picked, 0u);
    }
    for (var r = lid; r < RING_MAX; r += WG) {
        ring_wg[r] = state[RING_AT + r];
    }
    for (var w = lid; w < BLOOM_WORDS; w += WG) {
        atomicStore(&ring_bloom[w], 0u);
    }
    let shape = workgroupUniformLoad(&shape_wg);
    n_ring = shape.y;
    if (lid < n_ring) {  // WG >= RING_MAX
        let id = ring_wg[lid];
        atomicOr(&ring_bloom[(id >> 5u) % BLOOM_WORDS], 1u << (id & 31u));
    }
    let threshold = radix_select(lid, shape.x, K, 4u);  // its first barrier: the filter is complete
    for (var i = lid; i < shape.x; i += WG) {
        pick(candidate(i), threshold);
    }
    workgroupBarrier();
    if (lid == 0u) {
        picked_wg = atomicLoad(&n_picked);
    }
    let picked = workgroupUniformLoad(&picked_wg);
    if (picked <= N) {
        let width = max(2u, 1u << (32u - countLeadingZeros(max(picked, 2u) - 1u)));  // a power of two
//#for t in PER
        {
            let i = lid + {{t}}u * WG;
            if (i >= picked && i < max(width, K)) {  // fewer than K picked: the draw sees none past them
                sort_pairs[i] = vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX);
            }
        }
//#endfor
        workgroupBarrier();
        bitonic_sort_width(lid, width);
        return;
    }
    var next = 0u;  // the first candidate this chunk reads
    var first = 0u;  // the first place it fills
    loop {
//#for t in PER
        {
            let i = lid + {{t}}u * WG;
            let at = next + i - first;
            if (i >= first) {
                var pair = vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX);
                if (at < shape.x) {
                    pair = candidate(at);
                }
                sort_pairs[i] = pair;
            }
        }
//#endfor
        workgroupBarrier();
        bitonic_sort(lid);
        next += N - first;
        first = K;
        if (next >= shape.x) {
            break;
        }
    }
}

// All threads, once the list's count has been read (sort_candidates): the screen's state made ready for
// the next step, its KEY_SLOTS lower-bound keys zeroed and (thread 0) its candidate list emptied.
fn release_screen(lid: u32) {
    for (var i = lid; i < KEY_SLOTS; i += WG) {
        keys[i] = 0u;
    }
    if (lid == 0u) {
        atomicStore(&candidates.count, 0u);
    }
}
