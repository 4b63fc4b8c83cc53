// Snippet (//#include _topk_sort): what the GPU samplers share (sample_topk.wgsl, spec_sample.wgsl):
// the parameter block, the workgroup-wide bitonic sort of N (value, id) pairs, loading a span of
// logits or a block of candidate lists into it, and (FINAL) the candidates' weights, the top-p /
// min-p cut, the counter-based uniform stream and the inverse-CDF draw.
//
// Pairs order: valid before invalid (id NO_INDEX: past the end or NaN), larger value first, then the
// smaller id, so ties resolve like the CPU sampler and NaN never wins.
// The including kernel declares the bindings these functions read: `logits` (spans) or `lists_in`
// (LISTS), and `params` (FINAL).

const WG: u32 = ${WG};
const N: u32 = ${N};
const K: u32 = ${K};
const NO_INDEX: u32 = 0xffffffffu;
const LOWEST: f32 = -3.402823e38;
//#if LISTS
const FIRST_K: u32 = 2u * K;  // the input is already sorted in runs of K
//#else
const FIRST_K: u32 = 2u;
//#endif

struct SampleParams {
    top_k: u32,
    top_p: f32,           // 1 = off
    min_p: f32,           // 0 = off
    inv_temperature: f32,
    seed_lo: u32,
    seed_hi: u32,
    penalty: f32,         // repetition penalty, 1 = off
    window: u32,          // how many recent tokens it looks at (ring capacity, <= RING_MAX); 0 = none
};
// state: [0] draw counter, [1] status, [2] ring length, [3] ring head (next write), [4 ..] the ring
const RING_AT: u32 = 4u;

var<workgroup> sort_pairs: array<vec2<u32>, N>;  // (bitcast value, id)

fn before(a: vec2<u32>, b: vec2<u32>) -> bool {
    let va = bitcast<f32>(a.x);
    let vb = bitcast<f32>(b.x);
    return a.y != NO_INDEX && (b.y == NO_INDEX || va > vb || (va == vb && a.y < b.y));
}

// Sorts sort_pairs[0 .. width) (a power of two, 2 .. N) so that `before` holds between neighbours.
// Called by all WG threads with the same width; each stage is width / 2 compare-exchanges, up to PAIRS
// per thread (i < l = i + j always).
fn bitonic_sort_width(lid: u32, width: u32) {
    var log_j = countTrailingZeros(FIRST_K) - 1u;
    for (var k = FIRST_K; k <= width; k = k << 1u) {
        log_j = log_j + 1u;  // log2(k); j runs k/2 .. 1
        for (var lj = log_j; lj > 0u; lj = lj - 1u) {
            let j = 1u << (lj - 1u);
//#for t in PAIRS
            {
                let p = lid + {{t}}u * WG;  // pair number: insert a 0 bit at j's position
                if (p < width / 2u) {
                    let i = ((p >> (lj - 1u)) << lj) | (p & (j - 1u));
                    let l = i | j;
                    let a = sort_pairs[i];
                    let b = sort_pairs[l];
                    // (i & k) == 0: this block ends up in `before` order, else reversed (bitonic merge)
                    if (select(before(a, b), before(b, a), (i & k) == 0u)) {
                        sort_pairs[i] = b;
                        sort_pairs[l] = a;
                    }
                }
            }
//#endfor
            workgroupBarrier();
        }
    }
}

fn bitonic_sort(lid: u32) {
    bitonic_sort_width(lid, N);
}

//#if !PENALTY
//#if !ACCEPT
//#if !CANDIDATES
// All WG threads: sort_pairs = block `block` (N wide) of row `row`, sorted. Spans read logits
// [row * V + ...]; LISTS read lists_in[row * N_IN + ...] (sorted runs of K).
fn load_and_sort(lid: u32, block: u32, row: u32) {
//#for t in PER
    {
        let i = lid + {{t}}u * WG;
        let at = block * N + i;
//#if LISTS
        // sorted lists of K: odd ones reversed, so the sort starts at blocks of 2K (bitonic halves)
        let run_at = select(at, at ^ (K - 1u), ((at / K) & 1u) == 1u);
        var pair = vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX);
        if (run_at < N_IN) {
            pair = lists_in[row * N_IN + run_at];
        }
        sort_pairs[i] = pair;
//#else
        let value = logits[row * V + min(at, V - 1u)];
        let valid = at < V && value == value;  // NaN never becomes a candidate
        sort_pairs[i] = select(vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX), vec2<u32>(bitcast<u32>(value), at), valid);
//#endif
    }
//#endfor
    workgroupBarrier();
    bitonic_sort(lid);
}
//#endif
//#endif
//#endif

//#if FINAL
var<workgroup> weight_t1: array<f32, K>;
var<workgroup> weight_t: array<f32, K>;

// All WG threads, after load_and_sort: the candidates' weights (thread c: candidate c), at
// temperature 1 (for top-p, min-p) and at the set temperature. Returns the largest logit.
fn candidate_weights(lid: u32) -> f32 {
    let top = bitcast<f32>(sort_pairs[0].x);
    if (lid < K) {
        let pair = sort_pairs[lid];
        let candidate = lid < params.top_k && pair.y != NO_INDEX;
        let logit = bitcast<f32>(pair.x);
        weight_t1[lid] = select(0.0, exp(logit - top), candidate);  // temperature 1: top-p, min-p
        weight_t[lid] = select(0.0, exp((logit - top) * params.inv_temperature), candidate);
    }
    workgroupBarrier();
    return top;
}

// Wellons' lowbias32; sampler.py `_mix32` is the same function.
fn mix32(x_in: u32) -> u32 {
    var x = x_in;
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return x;
}

// sampler.py `uniform(seed, n)`: 24 random bits, exactly representable in f32.
fn uniform_draw(seed_lo: u32, seed_hi: u32, n: u32) -> f32 {
    let key = mix32(seed_lo ^ mix32(seed_hi + 0x9e3779b9u));
    return f32(mix32(n ^ key) >> 8u) * (1.0 / 16777216.0);
}

// How many of the sorted pairs are candidates (top-k, valid); 0: no valid logit.
fn count_candidates() -> u32 {
    var n_cand = 0u;
    for (var i = 0u; i < min(params.top_k, K); i++) {
        if (sort_pairs[i].y != NO_INDEX) {
            n_cand = i + 1u;
        }
    }
    return n_cand;
}

// How many of the n_cand > 0 candidates survive top-p and min-p (on the temperature-1 weights, the
// largest exactly 1); at least one.
fn keep_count(n_cand: u32) -> u32 {
    var total = 0.0;
    for (var i = 0u; i < n_cand; i++) {
        total += weight_t1[i];
    }
    var keep = n_cand;
    if (params.top_p < 1.0) {
        var cum = 0.0;
        for (var i = 0u; i < n_cand; i++) {
            cum += weight_t1[i];
            if (cum >= params.top_p * total) {  // the token that crosses top_p is kept
                keep = i + 1u;
                break;
            }
        }
    }
    if (params.min_p > 0.0) {
        var n_above = 0u;
        for (var i = 0u; i < n_cand; i++) {
            if (weight_t1[i] >= params.min_p) {
                n_above += 1u;
            }
        }
        keep = min(keep, n_above);
    }
    return max(keep, 1u);
}

// The inverse-CDF draw over the first `keep` candidates: the first whose cumulative weight exceeds
// u * sum (its index in sort order).
fn inverse_cdf(keep: u32, u: f32) -> u32 {
    var weight_sum = 0.0;
    for (var i = 0u; i < keep; i++) {
        weight_sum += weight_t[i];
    }
    let target_weight = u * weight_sum;
    var chosen = keep - 1u;
    var cum = 0.0;
    for (var i = 0u; i < keep; i++) {
        cum += weight_t[i];
        if (cum > target_weight) {
            chosen = i;
            break;
        }
    }
    return chosen;
}
//#endif
