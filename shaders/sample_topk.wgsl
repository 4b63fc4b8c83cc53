// Seeded top-k / top-p / min-p / temperature sampling on the GPU, so the next token id never has to
// leave the GPU (like argmax.wgsl for greedy decoding) and step n+1 can be queued behind step n.
//
// The distribution is exactly the CPU sampler's (sampler.py `choose`): candidates are the top_k
// logits (ties: the smaller id first); top-p and min-p cut that list at temperature 1; the draw is
// an inverse CDF over exp((l - l_max) / T) with u = uniform(seed, counter), the hash below being a
// bit-exact twin of sampler.py `uniform`. Only float rounding differs (f32 here, f64 there).
//
// PENALTY (optional, first): the repetition penalty on the logits of the tokens in a ring of the
// last `window` tokens (kept in `state`, appended to by FINAL), in place.
// Three more variants, one workgroup-wide bitonic sort of N (value, id) pairs each:
//   default:   workgroup g sorts logits g*N .. g*N+N-1 and writes its best K pairs to lists[g*K ..]
//   MERGE:     workgroup g sorts pairs g*N .. of a previous level's lists, writes its best K
//              (N / K lists per workgroup: 126 workgroups' lists -> 8 -> one)
//   FINAL:     one workgroup sorts the last <= N pairs, then thread 0 cuts and draws (<= K exps)
// Why sorts: top-k needs the exact k-th value; a 1024-wide bitonic sort in workgroup memory is
// 55 barrier steps, a few microseconds, against ~1.5 ms per decode step.
//
// Pairs order: valid before invalid (id NO_INDEX: past the end or NaN), larger value first, then the
// smaller id, so ties resolve like the CPU sampler and NaN never wins.
//
// Bindings:  default: 0 logits    [rows, V] f32 (row ROW is sampled)
//                     1 lists_out [GROUPS * K] vec2<u32>   (bitcast value, id)
//            MERGE:   0 lists_in  [N_IN] vec2<u32>
//                     1 lists_out [GROUPS * K] vec2<u32>
//            FINAL:   0 lists_in  [N_IN] vec2<u32>          (N_IN <= N)
//                     1 params    uniform SampleParams       (written once per generation)
//                     2 state     [4 + RING_MAX] u32: draw counter (+1 per token), status (1 = no
//                                 valid logit: token 0 was written), ring length, ring head, ring
//                     3 out_ids   [>= SLOT + 1] u32          (the next step's input token)
//            PENALTY: 0 logits (read_write), 1 params, 2 state (read)
//
// Dispatch: PENALTY (1), default (ceil(V / N)), MERGE (ceil(N_IN / N)), FINAL (1); workgroup WG threads, each
// loading PER = N / WG pairs and doing PAIRS = N / (2 WG) compare-exchanges per sorting stage.

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
//#if PENALTY
const V: u32 = ${V};
const ROW: u32 = ${ROW};
@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read> state: array<u32>;
//#else
//#if FINAL
const N_IN: u32 = ${N_IN};
const SLOT: u32 = ${SLOT};
@group(0) @binding(0) var<storage, read> lists_in: array<vec2<u32>>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read_write> state: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_ids: array<u32>;
//#else
//#if MERGE
const N_IN: u32 = ${N_IN};
@group(0) @binding(0) var<storage, read> lists_in: array<vec2<u32>>;
//#else
const V: u32 = ${V};
const ROW: u32 = ${ROW};
@group(0) @binding(0) var<storage, read> logits: array<f32>;
//#endif
@group(0) @binding(1) var<storage, read_write> lists_out: array<vec2<u32>>;
//#endif
//#endif

var<workgroup> sort_pairs: array<vec2<u32>, N>;  // (bitcast value, id)

fn before(a: vec2<u32>, b: vec2<u32>) -> bool {
    let va = bitcast<f32>(a.x);
    let vb = bitcast<f32>(b.x);
    return a.y != NO_INDEX && (b.y == NO_INDEX || va > vb || (va == vb && a.y < b.y));
}

// Sorts sort_pairs so that `before` holds between neighbours. Called by all WG threads; each
// stage is N / 2 compare-exchanges, PAIRS per thread, so no thread idles (i < l = i + j always).
fn bitonic_sort(lid: u32) {
    var log_j = countTrailingZeros(FIRST_K) - 1u;
    for (var k = FIRST_K; k <= N; k = k << 1u) {
        log_j = log_j + 1u;  // log2(k); j runs k/2 .. 1
        for (var lj = log_j; lj > 0u; lj = lj - 1u) {
            let j = 1u << (lj - 1u);
//#for t in PAIRS
            {
                let p = lid + {{t}}u * WG;  // pair number: insert a 0 bit at j's position
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
//#endfor
            workgroupBarrier();
        }
    }
}

//#if FINAL
var<workgroup> weight_t1: array<f32, K>;
var<workgroup> weight_t: array<f32, K>;

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

// Thread 0, after the sort and the weights: (token id, status 1 = no valid logit -> token 0).
fn draw_token(draw: u32, top: f32) -> vec2<u32> {
    var n_cand = 0u;
    for (var i = 0u; i < min(params.top_k, K); i++) {
        if (sort_pairs[i].y != NO_INDEX) {
            n_cand = i + 1u;
        }
    }
    if (n_cand == 0u) {
        return vec2<u32>(0u, 1u);
    }
    if (top > 3.402823e38) {  // +inf: the softmax is one-hot on the first +inf (CPU: argmax)
        return vec2<u32>(sort_pairs[0].y, 0u);
    }
    // top-p and min-p on the temperature-1 weights (the largest is exactly 1)
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
    keep = max(keep, 1u);
    // temperature, then the inverse-CDF draw: the first token whose cumulative weight exceeds u * sum
    var weight_sum = 0.0;
    for (var i = 0u; i < keep; i++) {
        weight_sum += weight_t[i];
    }
    let target_weight = uniform_draw(params.seed_lo, params.seed_hi, draw) * weight_sum;
    var chosen = keep - 1u;
    var cum = 0.0;
    for (var i = 0u; i < keep; i++) {
        cum += weight_t[i];
        if (cum > target_weight) {
            chosen = i;
            break;
        }
    }
    return vec2<u32>(sort_pairs[chosen].y, 0u);
}
//#endif

//#if PENALTY
// llama.cpp's repetition penalty on this row's logits, in place, before the spans read them: each
// distinct token among the last `window` (the ring) is divided by the penalty if positive, else
// multiplied. Thread r takes ring entry r and skips it when an earlier entry holds the same token.
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let n = min(state[2], params.window);
    if (lid >= n) {
        return;
    }
    let token = state[RING_AT + lid];
    for (var r = 0u; r < lid; r++) {
        if (state[RING_AT + r] == token) {
            return;
        }
    }
    if (token < V) {
        let at = ROW * V + token;
        let value = logits[at];
        logits[at] = select(value * params.penalty, value / params.penalty, value > 0.0);
    }
}
//#else
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
//#for t in PER
    {
        let i = lid + {{t}}u * WG;
//#if FINAL
        let at = i;
//#else
        let at = wid.x * N + i;
//#endif
//#if LISTS
        // sorted lists of K: odd ones reversed, so the sort starts at blocks of 2K (bitonic halves)
        let run_at = select(at, at ^ (K - 1u), ((at / K) & 1u) == 1u);
        var pair = vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX);
        if (run_at < N_IN) {
            pair = lists_in[run_at];
        }
        sort_pairs[i] = pair;
//#else
        let value = logits[ROW * V + min(at, V - 1u)];
        let valid = at < V && value == value;  // NaN never becomes a candidate
        sort_pairs[i] = select(vec2<u32>(bitcast<u32>(LOWEST), NO_INDEX), vec2<u32>(bitcast<u32>(value), at), valid);
//#endif
    }
//#endfor
    workgroupBarrier();
    bitonic_sort(lid);

//#if !FINAL
    if (lid < K) {
        lists_out[wid.x * K + lid] = sort_pairs[lid];
    }
//#else
    // Candidate weights in parallel (thread c: candidate c), then thread 0 walks the <= K prefix sums.
    let top = bitcast<f32>(sort_pairs[0].x);
    if (lid < K) {
        let pair = sort_pairs[lid];
        let candidate = lid < params.top_k && pair.y != NO_INDEX;
        let logit = bitcast<f32>(pair.x);
        weight_t1[lid] = select(0.0, exp(logit - top), candidate);  // temperature 1: top-p, min-p
        weight_t[lid] = select(0.0, exp((logit - top) * params.inv_temperature), candidate);
    }
    workgroupBarrier();
    if (lid != 0u) {
        return;
    }
    let draw = state[0];
    state[0] = draw + 1u;
    let chosen = draw_token(draw, top);
    out_ids[SLOT] = chosen.x;
    state[1] = chosen.y;
    if (params.window > 0u) {  // the ring of recent tokens the penalty pass reads next step
        let head = state[3];
        state[RING_AT + head] = chosen.x;
        state[3] = (head + 1u) % params.window;
        state[2] = min(state[2] + 1u, params.window);
    }
//#endif
}
//#endif
