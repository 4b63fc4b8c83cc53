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
// and one that replaces all four after an int8 screen (kernels/head_screen.py, sampled steps):
//   FINAL CANDIDATES: one workgroup reads the screen's candidate list (the F16 logits of the rows
//              that can be among the top K after the penalty: ~2,000 of 128,256 for 2B-4T), applies
//              the penalty to the ring's tokens among them, finds the K-th largest by radix select,
//              sorts the candidates that reach it, draws as FINAL, then empties the list and zeroes
//              the screen's keys.
// Why sorts: top-k needs the exact k-th value; a 1024-wide bitonic sort in workgroup memory is
// 55 barrier steps, a few microseconds, against ~1.5 ms per decode step.
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
//            CANDIDATES: 0 candidates (_candidates.wgsl), 1-3 as FINAL, 4 keys [KEY_SLOTS] u32
//            PENALTY: 0 logits (read_write), 1 params, 2 state (read)
//
// Dispatch: PENALTY (1), default (ceil(V / N)), MERGE (ceil(N_IN / N)), FINAL (1); workgroup WG threads, each
// loading PER = N / WG pairs and doing PAIRS = N / (2 WG) compare-exchanges per sorting stage.

//#include _topk_sort

//#if PENALTY
const V: u32 = ${V};
const ROW: u32 = ${ROW};
@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read> state: array<u32>;
//#else
//#if FINAL
const SLOT: u32 = ${SLOT};
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read_write> state: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_ids: array<u32>;
//#if CANDIDATES
//#include _candidates
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const RING_MAX: u32 = ${RING_MAX};
@group(0) @binding(0) var<storage, read_write> candidates: Candidates;
@group(0) @binding(4) var<storage, read_write> keys: array<u32>;
//#else
const N_IN: u32 = ${N_IN};
@group(0) @binding(0) var<storage, read> lists_in: array<vec2<u32>>;
//#endif
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

//#if FINAL
// Thread 0, after the sort and the weights: (token id, status 1 = no valid logit -> token 0).
fn draw_token(draw: u32, top: f32) -> vec2<u32> {
    let n_cand = count_candidates();
    if (n_cand == 0u) {
        return vec2<u32>(0u, 1u);
    }
    if (top > 3.402823e38) {  // +inf: the softmax is one-hot on the first +inf (CPU: argmax)
        return vec2<u32>(sort_pairs[0].y, 0u);
    }
    let index = inverse_cdf(keep_count(n_cand), uniform_draw(params.seed_lo, params.seed_hi, draw));
    return vec2<u32>(sort_pairs[index].y, 0u);
}
//#endif

//#if CANDIDATES
//#include _candidate_sort
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
//#if CANDIDATES
    sort_candidates(lid);
//#else
//#if LISTS
    load_and_sort(lid, wid.x, 0u);
//#else
    load_and_sort(lid, wid.x, ROW);
//#endif
//#endif
//#if !FINAL
    if (lid < K) {
        lists_out[wid.x * K + lid] = sort_pairs[lid];
    }
//#else
    // Candidate weights in parallel (thread c: candidate c), then thread 0 walks the <= K prefix sums.
    let top = candidate_weights(lid);
//#if CANDIDATES
    release_screen(lid);
//#endif
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
