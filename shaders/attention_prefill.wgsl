// Causal grouped-query attention for a prefill chunk, tiled over queries AND keys (flash style:
// online softmax, no score matrix in memory).
//
// Query token t (absolute position pos + t) of head qh attends to cache rows 0..pos+t with KV head
// qh / G, weights softmax(q . k * SCALE). Same function as attention.wgsl's prefill path, which
// serves only 8 query rows per workgroup and 16 keys per tile; this kernel gives each workgroup
// NQP query rows (BQ tokens x G heads of one KV head) and TK = 32 keys per tile, and register-blocks
// both products so each workgroup-memory read feeds several multiply-adds.
//
// Per tile (5 barriers): K rows -> kv (from registers loaded one tile ahead); scores: thread (a, b)
// = (lid / 16, lid % 16) computes queries RQ*a .. RQ*a+RQ-1 x keys b and b+16 (RQ x 2 dot products
// over HD, RQ + 2 vec4 reads per 4*RQ*2 multiply-adds), masked, into p; the NQP row threads take each
// row's new max and rescale factor; every score becomes exp(s - m) while the V rows (loaded during
// the scores) replace the K rows in kv; the row threads add the row sums; then thread (a, b)
// accumulates queries RQ*a.. x vec4 columns b + 16c (c < CV) over the tile's rows.
//
// Bindings:
//   0 params   uniform StepParams
//   1 q        [T, HQ * HD] f32 (vec4), rotated queries
//   2 k_cache  [capacity, HKV * HD] KVWord (_kv.wgsl: f16 pairs, or f32 with KV_F32), rows
//              0 .. pos + n_tokens - 1 written
//   3 v_cache  [capacity, HKV * HD] likewise
//   4 out      [T, HQ * HD] f32 (vec4)
//
// Workgroup: WG = 16 * NQP / RQ threads. Query row qi = b * G + g is token t0 + b, head kvh * G + g
// (rows past NQ = BQ * G or past n_tokens are padding). Needs HD % 64 == 0 (CV = HD / 64 >= 1).
// Dispatch: (ceil(n_tokens / BQ), HKV, 1); workgroup x takes token block nwg.x - 1 - x, so the
// blocks with the most keys start first.

${STEP_PARAMS}
//#include _kv

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const SCALE: f32 = ${SCALE};
const BQ: u32 = ${BQ};              // tokens per workgroup
const NQP: u32 = ${NQP};            // query rows per workgroup incl. padding
const RQ: u32 = ${RQ};              // query rows per thread
const WG: u32 = ${WG};              // = 16 * NQP / RQ

const G: u32 = HQ / HKV;            // query heads per KV head
const NQ: u32 = BQ * G;             // live query rows
const C4: u32 = HD / 4u;            // vec4 columns of one head
const CV: u32 = ${CV};              // = C4 / 16: vec4 output columns per thread
const TK: u32 = 32u;                // key rows per tile (16 lanes x 2)
const KS_ROW: u32 = C4 + 1u;        // padded K/V row in workgroup memory: no bank conflicts
const PS: u32 = TK + 1u;            // padded score row
const Q_ROW4: u32 = HQ * C4;
const KV_ROW4: u32 = HKV * C4;
const KV_ITEMS: u32 = ${KV_ITEMS};  // = TK * C4 / WG vec4 of K (and of V) per thread per tile
const Q_ITEMS: u32 = ${Q_ITEMS};    // = NQP * C4 / WG vec4 of queries per thread
const NEG: f32 = -3.0e38;           // "minus infinity" that stays finite through subtraction

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_cache: array<KVWord>;
@group(0) @binding(3) var<storage, read> v_cache: array<KVWord>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> qs: array<vec4<f32>, NQP * C4>;   // queries * SCALE [NQP, C4]
var<workgroup> kv: array<vec4<f32>, TK * KS_ROW>; // K tile, then V tile [TK, C4 (+1 pad)]
var<workgroup> p: array<f32, NQP * PS>;          // scores, then exp(score - max) [NQP, TK (+1 pad)]
var<workgroup> m_run: array<f32, NQP>;           // running max score per query row
var<workgroup> l_run: array<f32, NQP>;           // running sum of exp(score - m_run)
var<workgroup> alpha: array<f32, NQP>;           // exp(m_old - m_new) of the current tile

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let t0 = (nwg.x - 1u - wid.x) * BQ;
    let kvh = wid.y;
    let n_tokens = params.n_tokens;
    let pos = params.pos;
    if (t0 >= n_tokens) {
        return;
    }
    let kv_len = pos + min(t0 + BQ, n_tokens);  // rows visible to this block's last token
    let n_tiles = (kv_len + TK - 1u) / TK;
    let last_row = kv_len - 1u;
    let a = lid / 16u;
    let b = lid % 16u;

//#for i in Q_ITEMS
    {
        let idx = lid + {{i}}u * WG;
        let qi = idx / C4;
        let t = t0 + qi / G;
        var value = vec4<f32>(0.0);
        if (qi < NQ && t < n_tokens) {
            value = q[t * Q_ROW4 + (kvh * G + qi % G) * C4 + idx % C4] * SCALE;
        }
        qs[idx] = value;
    }
//#endfor
    if (lid < NQP) {
        m_run[lid] = NEG;
        l_run[lid] = 0.0;
    }

    // This thread's query rows: live ones see cache rows <= lim.
//#for i in RQ
    let qi{{i}} = RQ * a + {{i}}u;
    let live{{i}} = qi{{i}} < NQ && t0 + qi{{i}} / G < n_tokens;
    let lim{{i}} = pos + t0 + qi{{i}} / G;
//#for c in CV
    var acc{{i}}_{{c}} = vec4<f32>(0.0);
//#endfor
//#endfor

    // This thread's share of each K/V tile load (row kr, column kc), the first K tile in flight.
//#for i in KV_ITEMS
    let kr{{i}} = (lid + {{i}}u * WG) / C4;
    let kc{{i}} = kvh * C4 + (lid + {{i}}u * WG) % C4;
    let ks{{i}} = kr{{i}} * KS_ROW + (lid + {{i}}u * WG) % C4;
    var kreg{{i}} = k_cache[min(kr{{i}}, last_row) * KV_ROW4 + kc{{i}}];
    var vreg{{i}} = kv_zero();
//#endfor

    for (var tile = 0u; tile < n_tiles; tile++) {
        let base = tile * TK;
//#for i in KV_ITEMS
        kv[ks{{i}}] = kv_unpack(kreg{{i}});
//#endfor
        workgroupBarrier();
        // The V rows load while the scores are computed.
//#for i in KV_ITEMS
        vreg{{i}} = v_cache[min(base + kr{{i}}, last_row) * KV_ROW4 + kc{{i}}];
//#endfor

        // 1. scores s{i}{j} = q(RQ*a + i) . k(b + 16 j)
//#for i in RQ
        var s{{i}}0 = 0.0;
        var s{{i}}1 = 0.0;
//#endfor
        for (var d = 0u; d < C4; d += 4u) {
//#for u in 4
            {
                let k0 = kv[b * KS_ROW + d + {{u}}u];
                let k1 = kv[(b + 16u) * KS_ROW + d + {{u}}u];
//#for i in RQ
                let qv{{i}} = qs[qi{{i}} * C4 + d + {{u}}u];
                s{{i}}0 += dot(qv{{i}}, k0);
                s{{i}}1 += dot(qv{{i}}, k1);
//#endfor
            }
//#endfor
        }
//#for i in RQ
        p[qi{{i}} * PS + b] = select(NEG, s{{i}}0, live{{i}} && base + b <= lim{{i}});
        p[qi{{i}} * PS + b + 16u] = select(NEG, s{{i}}1, live{{i}} && base + b + 16u <= lim{{i}});
//#endfor
        workgroupBarrier();

        // 2. online softmax: each row's new max and the factor rescaling what was summed so far.
        if (lid < NQP) {
            let m_old = m_run[lid];
            var m = m_old;
            for (var r = 0u; r < TK; r += 8u) {
                let e = lid * PS + r;
                m = max(m, max(max(max(p[e], p[e + 1u]), max(p[e + 2u], p[e + 3u])),
                               max(max(p[e + 4u], p[e + 5u]), max(p[e + 6u], p[e + 7u]))));
            }
            alpha[lid] = exp(m_old - m);
            m_run[lid] = m;
        }
        workgroupBarrier();
//#for i in RQ
        {
            let m = m_run[qi{{i}}];
            let e = qi{{i}} * PS + b;
            let s0 = p[e];
            let s1 = p[e + 16u];
            p[e] = select(exp(s0 - m), 0.0, s0 == NEG);
            p[e + 16u] = select(exp(s1 - m), 0.0, s1 == NEG);
        }
//#endfor
        // Every K read of this tile is done (barrier above): the V rows take their place.
//#for i in KV_ITEMS
        kv[ks{{i}}] = kv_unpack(vreg{{i}});
//#endfor
        workgroupBarrier();

        if (lid < NQP) {
            var l = 0.0;
            for (var r = 0u; r < TK; r += 8u) {
                let e = lid * PS + r;
                l += p[e] + p[e + 1u] + p[e + 2u] + p[e + 3u] + p[e + 4u] + p[e + 5u] + p[e + 6u] + p[e + 7u];
            }
            l_run[lid] = l_run[lid] * alpha[lid] + l;
        }
        // The next K tile loads while this one's values are summed.
        let next = min(tile + 1u, n_tiles - 1u) * TK;
//#for i in KV_ITEMS
        kreg{{i}} = k_cache[min(next + kr{{i}}, last_row) * KV_ROW4 + kc{{i}}];
//#endfor

        // 3. acc = acc * alpha + sum over the tile's rows of p * V.
//#for i in RQ
        let al{{i}} = alpha[qi{{i}}];
//#for c in CV
        acc{{i}}_{{c}} *= al{{i}};
//#endfor
//#endfor
        for (var r = 0u; r < TK; r += 4u) {
//#for u in 4
            {
//#for c in CV
                let v{{c}} = kv[(r + {{u}}u) * KS_ROW + b + 16u * {{c}}u];
//#endfor
//#for i in RQ
                let pr{{i}} = p[qi{{i}} * PS + r + {{u}}u];
//#for c in CV
                acc{{i}}_{{c}} += pr{{i}} * v{{c}};
//#endfor
//#endfor
            }
//#endfor
        }
        workgroupBarrier();
    }

//#for i in RQ
    if (live{{i}}) {
        let inv_l = 1.0 / l_run[qi{{i}}];
        let row = (t0 + qi{{i}} / G) * Q_ROW4 + (kvh * G + qi{{i}} % G) * C4 + b;
//#for c in CV
        out[row + 16u * {{c}}u] = acc{{i}}_{{c}} * inv_l;
//#endfor
    }
//#endfor
}
