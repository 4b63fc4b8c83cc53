// Causal grouped-query attention over the KV cache, flash style (online softmax, no score matrix).
//
// Query token t (absolute position pos + t) of head qh attends to cache rows 0..pos+t with
// KV head qh / G, weights softmax(q . k * SCALE).
//
// One workgroup = one KV head x BQ consecutive tokens, i.e. NQ = BQ * G query rows sharing every
// K/V row it loads (NQ * C4 <= WG, so each invocation owns at most one output vec4). Key rows are
// walked in tiles of TILE rows; per tile:
//   1. scores: one (row, query) pair per invocation and loop step, LOADS K vec4 issued per batch;
//   2. online softmax: tile max (tree), p = exp(s - m_new), tile sum (tree); invocations < NQ keep
//      the running max / sum of their query in workgroup memory;
//   3. values: invocation (col = i % C4, query = i / C4) rescales its accumulator and adds
//      p * V[row, col] over the tile's rows, LOADS rows per batch.
// Every loop body keeps its loads in named locals (no function-scope arrays): a driver that does not
// unroll a loop must still not spill or serialize the loads.
//
// SPLIT = false (prefill): the workgroup walks every tile up to its last token's row and writes
//   out [T, HQ*HD] f32 = acc / l. Dispatch (1, HKV, ceil(T / BQ)).
// SPLIT = true (decode, long contexts): workgroup x handles only tile x (rows x*TILE ..), so a
//   4k context keeps 64 workgroups per KV head busy, and writes the unnormalized partial
//   (acc, m, l) for attention_combine.wgsl. BQ must be 1. Dispatch (n_splits, HKV, T) with
//   n_splits >= ceil((pos + T) / TILE); workgroups past the last row exit at once.
//
// Bindings:
//   0 params   uniform StepParams
//   1 q        [T, HQ * HD] f32 (vec4)        rotated queries
//   2 k_cache  [capacity, HKV * HD] f32 (vec4)
//   3 v_cache  [capacity, HKV * HD] f32 (vec4)
//   4 out      SPLIT: partial acc [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32; else [T, HQ * HD] f32
//   5 stats    SPLIT: partial (m, l) [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>; else not written

${STEP_PARAMS}

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const BQ: u32 = ${BQ};
const TILE: u32 = ${TILE};
const WG: u32 = ${WG};
const SPLIT: bool = ${SPLIT};
const MAX_SPLITS: u32 = ${MAX_SPLITS};
const SCALE: f32 = ${SCALE};

const G: u32 = HQ / HKV;            // query heads per KV head
const C4: u32 = HD / 4u;            // vec4 columns of one head (a multiple of 8)
const NQ: u32 = BQ * G;             // query rows of one workgroup, index qi = b * G + (qh % G)
const Q_ROW4: u32 = HQ * C4;
const KV_ROW4: u32 = HKV * C4;
const NEG: f32 = -3.0e38;           // "minus infinity" that stays finite through subtraction

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> qs: array<vec4<f32>, NQ * C4>;   // queries * SCALE, [NQ, C4]
var<workgroup> probs: array<f32, NQ * TILE>;     // scores, then p, of the current tile [NQ, TILE]
var<workgroup> red: array<f32, NQ * TILE>;       // reduction scratch [NQ, TILE]
var<workgroup> m_run: array<f32, NQ>;            // running max score per query
var<workgroup> l_run: array<f32, NQ>;            // running sum of exp(score - m_run) per query
var<workgroup> alpha: array<f32, NQ>;            // exp(m_old - m_new) of the current tile

// q[qi] . K[row] (q already scaled), 8 vec4 loads in flight per step.
fn score(row: u32, kvh: u32, qi: u32) -> f32 {
    let kb = row * KV_ROW4 + kvh * C4;
    let qb = qi * C4;
    var s = 0.0;
    for (var c = 0u; c < C4; c += 8u) {
        let k0 = k_cache[kb + c];
        let k1 = k_cache[kb + c + 1u];
        let k2 = k_cache[kb + c + 2u];
        let k3 = k_cache[kb + c + 3u];
        let k4 = k_cache[kb + c + 4u];
        let k5 = k_cache[kb + c + 5u];
        let k6 = k_cache[kb + c + 6u];
        let k7 = k_cache[kb + c + 7u];
        s += dot(qs[qb + c], k0) + dot(qs[qb + c + 1u], k1) + dot(qs[qb + c + 2u], k2)
           + dot(qs[qb + c + 3u], k3) + dot(qs[qb + c + 4u], k4) + dot(qs[qb + c + 5u], k5)
           + dot(qs[qb + c + 6u], k6) + dot(qs[qb + c + 7u], k7);
    }
    return s;
}

// Tree reductions of red[qi * TILE + 0 .. TILE] for every qi; the result lands in red[qi * TILE].
fn reduce_max(tid: u32) {
    for (var stride = TILE / 2u; stride > 0u; stride = stride / 2u) {
        for (var e = tid; e < NQ * stride; e += WG) {
            let i = (e / stride) * TILE + e % stride;
            red[i] = max(red[i], red[i + stride]);
        }
        workgroupBarrier();
    }
}

fn reduce_sum(tid: u32) {
    for (var stride = TILE / 2u; stride > 0u; stride = stride / 2u) {
        for (var e = tid; e < NQ * stride; e += WG) {
            let i = (e / stride) * TILE + e % stride;
            red[i] = red[i] + red[i + stride];
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let kvh = wid.y;
    let n_tokens = params.n_tokens;
    let pos = params.pos;
    let t0 = wid.z * BQ;
    if (t0 >= n_tokens) {
        return;
    }
    let kv_len = pos + min(t0 + BQ, n_tokens);   // rows visible to this workgroup's last token

    var row_begin = 0u;
    var row_end = kv_len;
    if (SPLIT) {
        row_begin = wid.x * TILE;
        row_end = min(kv_len, row_begin + TILE);
        if (row_begin >= kv_len) {
            return;
        }
    }

    // Queries of this workgroup, pre-scaled; rows of tokens past n_tokens are zero.
    for (var i = tid; i < NQ * C4; i += WG) {
        let qi = i / C4;
        let t = t0 + qi / G;
        let qh = kvh * G + qi % G;
        var value = vec4<f32>(0.0);
        if (t < n_tokens) {
            value = q[t * Q_ROW4 + qh * C4 + i % C4] * SCALE;
        }
        qs[i] = value;
    }
    if (tid < NQ) {
        m_run[tid] = NEG;
        l_run[tid] = 0.0;
    }
    workgroupBarrier();

    let col = tid % C4;
    let vq = tid / C4;                 // this invocation's query in the value phase
    let v_active = vq < NQ;
    let v_probs = min(vq, NQ - 1u) * TILE;
    var acc = vec4<f32>(0.0);

    for (var base = row_begin; base < row_end; base += TILE) {
        // 1. scores. Query qi (token t0 + qi / G) sees rows <= pos + t0 + qi / G.
        for (var e = tid; e < NQ * TILE; e += WG) {
            let qi = e / TILE;
            let row = base + e % TILE;
            var s = NEG;
            if (row < row_end && row <= pos + t0 + qi / G) {
                s = score(row, kvh, qi);
            }
            probs[e] = s;
            red[e] = s;
        }
        workgroupBarrier();

        // 2. online softmax update.
        reduce_max(tid);
        if (tid < NQ) {
            let m_old = m_run[tid];
            let m_new = max(m_old, red[tid * TILE]);
            alpha[tid] = exp(m_old - m_new);
            m_run[tid] = m_new;
        }
        workgroupBarrier();
        for (var e = tid; e < NQ * TILE; e += WG) {
            let s = probs[e];
            let p = select(exp(s - m_run[e / TILE]), 0.0, s == NEG);
            probs[e] = p;
            red[e] = p;
        }
        workgroupBarrier();
        reduce_sum(tid);
        if (tid < NQ) {
            l_run[tid] = l_run[tid] * alpha[tid] + red[tid * TILE];
        }

        // 3. acc = acc * alpha + sum over the tile's rows of p * V[row, col].
        if (v_active) {
            var a = acc * alpha[vq];
            let n_rows = min(TILE, row_end - base);
            let last = row_end - 1u;
            let vb = kvh * C4 + col;
            for (var r = 0u; r < n_rows; r += 8u) {
                // Rows past the tile's end re-read the last valid row; their p is 0.
                let row = base + r;
                let v0 = v_cache[min(row, last) * KV_ROW4 + vb];
                let v1 = v_cache[min(row + 1u, last) * KV_ROW4 + vb];
                let v2 = v_cache[min(row + 2u, last) * KV_ROW4 + vb];
                let v3 = v_cache[min(row + 3u, last) * KV_ROW4 + vb];
                let v4 = v_cache[min(row + 4u, last) * KV_ROW4 + vb];
                let v5 = v_cache[min(row + 5u, last) * KV_ROW4 + vb];
                let v6 = v_cache[min(row + 6u, last) * KV_ROW4 + vb];
                let v7 = v_cache[min(row + 7u, last) * KV_ROW4 + vb];
                let pb = v_probs + r;
                a += probs[pb] * v0 + probs[pb + 1u] * v1 + probs[pb + 2u] * v2 + probs[pb + 3u] * v3
                   + probs[pb + 4u] * v4 + probs[pb + 5u] * v5 + probs[pb + 6u] * v6 + probs[pb + 7u] * v7;
            }
            acc = a;
        }
        workgroupBarrier();
    }

    let t = t0 + vq / G;
    if (v_active && t < n_tokens) {
        let qh = kvh * G + vq % G;
        if (SPLIT) {
            let slot = (t * HQ + qh) * MAX_SPLITS + wid.x;
            out[slot * C4 + col] = acc;
            if (col == 0u) {
                stats[slot] = vec2<f32>(m_run[vq], l_run[vq]);
            }
        } else {
            out[t * Q_ROW4 + qh * C4 + col] = acc / l_run[vq];
        }
    }
}
