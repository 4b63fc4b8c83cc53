// Causal grouped-query attention over the KV cache, flash style (online softmax, no score matrix).
//
// Query token t (absolute position pos + t) of head qh attends to cache rows 0..pos+t with
// KV head qh / G, weights softmax(q . k * SCALE).
//
// One workgroup = one KV head x BQ consecutive tokens: NQ = BQ * G query rows share every K/V row
// it loads. Key rows are walked in tiles of TILE rows (TILE * HD / 4 = 2 * WG, so each invocation
// loads 2 vec4 of K and 2 of V per tile, coalesced, the next tile's loads issued before the current
// tile's arithmetic). Per tile, from workgroup memory:
//   1. scores: invocation (query i / TILE, row i % TILE) dots its query with its K row;
//   2. online softmax: invocation qi < NQ takes its query's tile max and rescale factor, then every
//      score becomes p = exp(s - m_new), then invocation qi < NQ adds its query's p to the running sum;
//   3. values (alongside the sum): invocation (query i / C4, column i % C4) rescales its accumulator
//      and adds p * V.
// Why this shape (measured on an H100 through wgpu/naga): one workgroup streams only ~30 GB/s from
// L2, so every K/V element is loaded from memory once per workgroup (attention_decode.wgsl splits long
// contexts over many workgroups); loops are not unrolled by the driver and each iteration waits for its loads
// (~100 cycles even from workgroup memory), so every inner loop takes 8 independent loads per
// iteration, and the per-query reductions are short loops rather than barrier-separated trees.
//
// The workgroup walks every tile up to its last token's row and writes out [T, HQ*HD] f32 = acc / l.
// Dispatch (1, HKV, ceil(T / BQ)). Prefill fallback where attention_prefill.wgsl does not apply; decoding
// takes attention_decode.wgsl.
//
// Bindings:
//   0 params   uniform StepParams
//   1 q        [T, HQ * HD] f32 (vec4), rotated queries (RoPE applied, K/V rows appended by rope.wgsl)
//   2 k_cache  [capacity, HKV * HD] KVWord per 4 values (_kv.wgsl)
//   3 v_cache  [capacity, HKV * HD] likewise
//   4 out      [T, HQ * HD] f32

${STEP_PARAMS}
//#include _kv

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const BQ: u32 = ${BQ};
const TILE: u32 = ${TILE};
const WG: u32 = ${WG};
const SCALE: f32 = ${SCALE};

const G: u32 = HQ / HKV;            // query heads per KV head
const C4: u32 = HD / 4u;            // vec4 columns of one head
const NQ: u32 = BQ * G;             // query rows of one workgroup, index qi = b * G + (qh % G)
const KS_ROW: u32 = C4 + 1u;        // padded K row in workgroup memory: no bank conflicts
const LOAD_ROWS: u32 = WG / C4;     // tile rows covered by one load of every invocation
const Q_ROW4: u32 = HQ * C4;
const KV_ROW4: u32 = HKV * C4;
const NEG: f32 = -3.0e38;           // "minus infinity" that stays finite through subtraction

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_cache: array<KVWord>;
@group(0) @binding(3) var<storage, read> v_cache: array<KVWord>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> ks: array<vec4<f32>, TILE * KS_ROW>;  // K tile [TILE, C4 (+1 pad)]
var<workgroup> vs: array<vec4<f32>, TILE * C4>;      // V tile [TILE, C4]
var<workgroup> qs: array<vec4<f32>, NQ * C4>;        // queries * SCALE [NQ, C4]
var<workgroup> probs: array<f32, NQ * TILE>;         // scores, then p [NQ, TILE]
var<workgroup> m_run: array<f32, NQ>;                // running max score per query
var<workgroup> l_run: array<f32, NQ>;                // running sum of exp(score - m_run) per query
var<workgroup> alpha: array<f32, NQ>;                // exp(m_old - m_new) of the current tile

// Max of probs[b .. b + 8].
fn max8(b: u32) -> f32 {
    return max(max(max(probs[b], probs[b + 1u]), max(probs[b + 2u], probs[b + 3u])),
               max(max(probs[b + 4u], probs[b + 5u]), max(probs[b + 6u], probs[b + 7u])));
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
    let kv_len = pos + min(t0 + BQ, n_tokens);  // rows visible to this workgroup's last token
    let tile_end = (kv_len + TILE - 1u) / TILE;

    // Queries of this workgroup, pre-scaled; rows of tokens past n_tokens are zero.
    if (tid < NQ * C4) {
        let qi = tid / C4;
        let t = t0 + qi / G;
        let qh = kvh * G + qi % G;
        var value = vec4<f32>(0.0);
        if (t < n_tokens) {
            value = q[t * Q_ROW4 + qh * C4 + tid % C4] * SCALE;
        }
        qs[tid] = value;
    }

    // This invocation's share of each tile load: rows lr and lr + LOAD_ROWS, column lc.
    let lr = tid / C4;
    let lc = tid % C4;
    let last_row = kv_len - 1u;
    let head_col = kvh * C4 + lc;
    var base = 0u;
    var row_a = min(lr, last_row);
    var row_b = min(lr + LOAD_ROWS, last_row);
    var k_a = k_cache[row_a * KV_ROW4 + head_col];
    var k_b = k_cache[row_b * KV_ROW4 + head_col];
    var v_a = v_cache[row_a * KV_ROW4 + head_col];
    var v_b = v_cache[row_b * KV_ROW4 + head_col];

    if (tid < NQ) {
        m_run[tid] = NEG;
        l_run[tid] = 0.0;
    }

    let sq = tid / TILE;               // score phase: query and row of this invocation
    let sr = tid % TILE;
    let s_limit = pos + t0 + sq / G;   // last row query sq may see
    let vq = tid / C4;                 // value phase: query and column of this invocation
    var acc = vec4<f32>(0.0);

    for (var tile = 0u; tile < tile_end; tile++) {
        base = tile * TILE;
        ks[lr * KS_ROW + lc] = kv_unpack(k_a);
        ks[(lr + LOAD_ROWS) * KS_ROW + lc] = kv_unpack(k_b);
        vs[lr * C4 + lc] = kv_unpack(v_a);
        vs[(lr + LOAD_ROWS) * C4 + lc] = kv_unpack(v_b);
        workgroupBarrier();

        // Issue the next tile's loads now; they land while this tile is computed.
        let next = min(tile + 1u, tile_end - 1u) * TILE;
        row_a = min(next + lr, last_row);
        row_b = min(next + lr + LOAD_ROWS, last_row);
        k_a = k_cache[row_a * KV_ROW4 + head_col];
        k_b = k_cache[row_b * KV_ROW4 + head_col];
        v_a = v_cache[row_a * KV_ROW4 + head_col];
        v_b = v_cache[row_b * KV_ROW4 + head_col];

        // 1. scores.
        if (sq < NQ) {
            let row = base + sr;
            var s = NEG;
            if (row <= s_limit && row < kv_len) {
                let qb = sq * C4;
                let kb = sr * KS_ROW;
                var d = 0.0;
                for (var c = 0u; c < C4; c += 8u) {
                    d += dot(qs[qb + c], ks[kb + c]) + dot(qs[qb + c + 1u], ks[kb + c + 1u])
                       + dot(qs[qb + c + 2u], ks[kb + c + 2u]) + dot(qs[qb + c + 3u], ks[kb + c + 3u])
                       + dot(qs[qb + c + 4u], ks[kb + c + 4u]) + dot(qs[qb + c + 5u], ks[kb + c + 5u])
                       + dot(qs[qb + c + 6u], ks[kb + c + 6u]) + dot(qs[qb + c + 7u], ks[kb + c + 7u]);
                }
                s = d;
            }
            probs[tid] = s;
        }
        workgroupBarrier();

        // 2. online softmax: new running max and the factor rescaling what was summed so far.
        if (tid < NQ) {
            var m = m_run[tid];
            for (var r = 0u; r < TILE; r += 8u) {
                m = max(m, max8(tid * TILE + r));
            }
            alpha[tid] = exp(m_run[tid] - m);
            m_run[tid] = m;
        }
        workgroupBarrier();
        if (sq < NQ) {
            let s = probs[tid];
            probs[tid] = select(exp(s - m_run[sq]), 0.0, s == NEG);
        }
        workgroupBarrier();
        if (tid < NQ) {
            var l = 0.0;
            for (var r = 0u; r < TILE; r += 8u) {
                let b = tid * TILE + r;
                l += probs[b] + probs[b + 1u] + probs[b + 2u] + probs[b + 3u]
                   + probs[b + 4u] + probs[b + 5u] + probs[b + 6u] + probs[b + 7u];
            }
            l_run[tid] = l_run[tid] * alpha[tid] + l;
        }

        // 3. acc = acc * alpha + sum over the tile's rows of p * V[row, col].
        if (vq < NQ) {
            var a = acc * alpha[vq];
            for (var r = 0u; r < TILE; r += 8u) {
                let pb = vq * TILE + r;
                let vb = r * C4 + lc;
                a += probs[pb] * vs[vb] + probs[pb + 1u] * vs[vb + C4] + probs[pb + 2u] * vs[vb + 2u * C4]
                   + probs[pb + 3u] * vs[vb + 3u * C4] + probs[pb + 4u] * vs[vb + 4u * C4]
                   + probs[pb + 5u] * vs[vb + 5u * C4] + probs[pb + 6u] * vs[vb + 6u * C4]
                   + probs[pb + 7u] * vs[vb + 7u * C4];
            }
            acc = a;
        }
        workgroupBarrier();
    }

    let t = t0 + vq / G;
    if (vq < NQ && t < n_tokens) {
        out[t * Q_ROW4 + (kvh * G + vq % G) * C4 + lc] = acc / l_run[vq];
    }
}
