// Decode attention over the KV cache: a few query tokens (1 when decoding, k + 1 in a speculative verify
// step), each attending causally to all cached rows, the rows walked in chunks of CHUNK by one or many
// workgroups (flash decoding).
//
// Query token t (absolute position pos + t) of head qh attends to cache rows 0..pos+t of KV head qh / G,
// weights softmax(q . k * SCALE).
//
// One workgroup = one KV head x one token t (kv_len = pos + t + 1 visible rows) x a run of chunks; the G
// query heads of the KV head share every K/V row it loads. n_chunks = ceil(kv_len / CHUNK).
//   SPLIT = true: the chunks are dealt to n_splits = min(n_chunks, MAX_SPLITS) workgroups
//     (ceil(n_chunks / n_splits) consecutive chunks each); each writes its unnormalized partial
//     (acc, m, l) for attention_combine.wgsl. Dispatch (>= n_splits, HKV, n_tokens); workgroups without
//     chunks exit at once.
//   SPLIT = false (direct): one workgroup walks every chunk and writes acc / l. Dispatch (1, HKV, n_tokens).
//
// Thread mapping, per chunk (one barrier):
//   loads   score item i = tid + k * WG (k < SR), i < CHUNK * G * KS, is (chunk row i / (G * KS), query
//           (i / KS) % G, part i % KS): its invocation loads part `part` of that row's K head (C4 / KS
//           words). Value invocation tid < S * GQ * C4 is (slice, query group gq, column col): it loads
//           column col of the chunk's V rows slice, slice + S, ... (R = CHUNK / S rows, coalesced
//           across col). Every load of the chunk is issued before any arithmetic.
//   scores  q . k over the part (SCALE folded into q) into scores[chunk parity], then the barrier; the
//           value phase adds the KS parts and masks rows past kv_len. The two buffers let the next
//           chunk's scores be written without a second barrier: its writes come after this chunk's
//           barrier, which every reader of the other buffer has passed.
//   values  each value invocation keeps its own online softmax (running max m, sum l, vec4 acc) for
//           its GV queries over its own rows, reading only its R scores per query: no workgroup-wide
//           max, at the price of each score being exponentiated by the C4 invocations of its row.
// At the end the S slices' (acc, m, l) are merged in workgroup memory (one more barrier) by
// invocation (query g, column c) for tid < G * C4.
// Why this shape (measured on an H100 and an H200 through wgpu/naga): decode attention is latency-bound
// (a 4k context's K/V is ~3.5 us of HBM time per layer); per-tile barriers and loops that wait on each
// iteration's loads were the cost. No subgroup operations, so nothing depends on the subgroup size. `//#for` unrolls every inner loop (naga's loops are not unrolled by
// the driver), so each invocation keeps its loads in flight together.
//
// Entry points:
//   main       queries from `q` (RoPE already applied, K/V rows already appended by rope.wgsl).
//   main_rope  decode of one token with RoPE fused in: binding 1 is the fused projection qkv; the
//              queries and row pos's k are rotated on load (as rope.wgsl does; needs ROPE_DIM % 8 == 0),
//              row pos (rotated k, plain v, rounded as stored) is taken from workgroup memory /
//              registers in place of the cache row, and appended to the cache by the workgroup whose
//              chunks hold it (nothing in the dispatch reads it back from memory). n_tokens must be 1.
//
// Bindings (main uses 0-5, main_rope 0-6):
//   0 params   uniform StepParams
//   1 q        main: [T, HQ * HD] f32 (vec4), rotated queries;
//              main_rope: qkv [1, (HQ + 2 * HKV) * HD] f32 (vec4), fused projection (q, k, v heads)
//   2 k_cache  [capacity, HKV * HD] KVWord per 4 values (_kv.wgsl) (read_write only for main_rope)
//   3 v_cache  [capacity, HKV * HD] likewise
//   4 out      SPLIT: partial acc [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32; else [T, HQ * HD] f32
//   5 stats    SPLIT: partial (m, l) [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>; else not written
//   6 table    main_rope: [n_positions, ROPE_DIM / 2] (cos, sin) pairs, read as vec4 (two pairs)

${STEP_PARAMS}
//#include _kv

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const G: u32 = ${G};            // query heads per KV head
const C4: u32 = ${C4};          // vec4 columns of one head (HD / 4)
const KS: u32 = ${KS};          // parts of a K row dotted by separate invocations
const CK: u32 = C4 / KS;        // K words per score item
const CKQ: u32 = ${CKQ};        // CK / 4
const CHUNK: u32 = ${CHUNK};    // key rows per chunk
const WG: u32 = ${WG};
const SR: u32 = ${SR};          // score items per invocation, ceil(CHUNK * G * KS / WG)
const GV: u32 = ${GV};          // queries per value invocation
const GQ: u32 = G / GV;         // query groups of the value phase
const S: u32 = ${S};            // value slices, S * GQ * C4 <= WG
const R: u32 = ${R};            // rows per value invocation and chunk, CHUNK / S
const SPLIT: bool = ${SPLIT};
const MAX_SPLITS: u32 = ${MAX_SPLITS};
const SCALE: f32 = ${SCALE};
const ROPE_DIM: u32 = ${ROPE_DIM};
const NEOX: bool = ${NEOX};

const Q_ROW4: u32 = HQ * C4;
const KV_ROW4: u32 = HKV * C4;
const QS_ROW: u32 = C4 + 1u;    // padded query row: the G queries read together sit in different banks
const NEG: f32 = -3.0e38;       // "minus infinity" that stays finite through subtraction

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<KVWord>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<KVWord>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read> table: array<vec4<f32>>;

var<workgroup> qs: array<vec4<f32>, G * QS_ROW>;        // queries * SCALE [G, C4 (+1 pad)]
var<workgroup> k_new: array<KVWord, C4>;                 // main_rope: row pos's k as stored
var<workgroup> scores: array<f32, 2u * KS * G * CHUNK>;  // [chunk parity, part, query, chunk row]
var<workgroup> merge_acc: array<vec4<f32>, S * G * C4>;  // [slice, query, column]
var<workgroup> merge_ml: array<vec2<f32>, S * G>;        // (m, l) [slice, query]

// Which rows this workgroup attends over; `ok` is false for workgroups with nothing to do.
struct Work {
    ok: bool,
    t: u32,           // the query token
    kv_len: u32,      // rows visible to it
    chunk_begin: u32,
    chunk_end: u32,
};

fn plan(wid: vec3<u32>) -> Work {
    var w: Work;
    w.t = wid.z;
    w.ok = w.t < params.n_tokens;
    w.kv_len = params.pos + w.t + 1u;
    let n_chunks = (w.kv_len + CHUNK - 1u) / CHUNK;
    w.chunk_begin = 0u;
    w.chunk_end = n_chunks;
    if (SPLIT) {
        let n_splits = min(n_chunks, MAX_SPLITS);
        let per_split = (n_chunks + n_splits - 1u) / n_splits;
        w.chunk_begin = wid.x * per_split;
        w.chunk_end = min(n_chunks, w.chunk_begin + per_split);
        w.ok = w.ok && w.chunk_begin < w.chunk_end;
    }
    return w;
}

// Column c (vec4) of the head starting at vec4 `head` of qkv (binding 1), rotated for `position`.
fn rope_vec4(head: u32, c: u32, position: u32) -> vec4<f32> {
    let x = q[head + c];
    if (4u * c >= ROPE_DIM) {
        return x;
    }
    let row = position * (ROPE_DIM / 4u);   // table vec4s per position
    if (NEOX) {
        // Dims 4c..4c+3 pair with the same dims of the other half (rotate-half).
        let half4 = ROPE_DIM / 8u;
        let first = c < half4;
        let j = select(c - half4, c, first);
        let partner = q[head + select(c - half4, c + half4, first)];
        let cs01 = table[row + 2u * j];
        let cs23 = table[row + 2u * j + 1u];
        let cos = vec4<f32>(cs01.x, cs01.z, cs23.x, cs23.z);
        let sin = vec4<f32>(cs01.y, cs01.w, cs23.y, cs23.w);
        return x * cos + select(partner, -partner, first) * sin;
    }
    // Interleaved: pairs (x, y) and (z, w) use frequencies 2c and 2c + 1.
    let cs = table[row + c];
    return vec4<f32>(x.x * cs.x - x.y * cs.y, x.y * cs.x + x.x * cs.y,
                     x.z * cs.z - x.w * cs.w, x.w * cs.z + x.z * cs.w);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let w = plan(wid);
    if (!w.ok) {
        return;
    }
    if (tid < G * C4) {
        let g = tid / C4;
        qs[g * QS_ROW + tid % C4] = q[w.t * Q_ROW4 + (wid.y * G + g) * C4 + tid % C4] * SCALE;
    }
    attend(tid, wid, w, false);
}

@compute @workgroup_size(WG)
fn main_rope(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let w = plan(wid);
    if (!w.ok) {
        return;
    }
    let kvh = wid.y;
    let pos = params.pos;
    if (tid < G * C4) {
        let g = tid / C4;
        qs[g * QS_ROW + tid % C4] = rope_vec4((kvh * G + g) * C4, tid % C4, pos) * SCALE;
    }
    if (tid < C4) {
        // Packed as stored, so this step sees row pos exactly as later steps will read it.
        let k_word = kv_pack(rope_vec4((HQ + kvh) * C4, tid, pos));
        k_new[tid] = k_word;
        // The workgroup whose chunks hold row pos appends it; nothing in this dispatch reads it back.
        if (pos >= w.chunk_begin * CHUNK && pos < w.chunk_end * CHUNK && pos < params.kv_capacity) {
            k_cache[pos * KV_ROW4 + kvh * C4 + tid] = k_word;
            v_cache[pos * KV_ROW4 + kvh * C4 + tid] = kv_pack(q[(HQ + HKV + kvh) * C4 + tid]);
        }
    }
    attend(tid, wid, w, true);
}

// The chunk walk shared by both entry points; qs (and with `has_new` k_new) must be written. With
// `has_new`, cache row pos is taken from k_new and this invocation's column of v instead of memory.
fn attend(tid: u32, wid: vec3<u32>, w: Work, has_new: bool) {
    let kvh = wid.y;
    let head = kvh * C4;
    let last_row = w.kv_len - 1u;
    let new_row = select(0xffffffffu, params.pos, has_new);
    // Value invocation: (slice, query group gq, column col); rows past the chunk are clamped, unused.
    let col = tid % C4;
    let gq = (tid / C4) % GQ;
    let slice = tid / (C4 * GQ);
    let is_value = slice < S;
    var v_new = kv_zero();
    if (has_new) {
        v_new = kv_pack(q[(HQ + HKV + kvh) * C4 + col]);
    }
    //#for j in GV
    var m{{j}} = NEG;
    var l{{j}} = 0.0;
    var acc{{j}} = vec4<f32>(0.0);
    //#endfor
    workgroupBarrier();  // qs, k_new

    for (var chunk = w.chunk_begin; chunk < w.chunk_end; chunk++) {
        let base = chunk * CHUNK;
        let buf = (chunk & 1u) * (KS * G * CHUNK);
        // This invocation's V rows, loaded before the scores are computed.
        //#for i in R
        let vr{{i}} = min(base + slice + {{i}}u * S, last_row);
        let vw{{i}} = select(v_cache[vr{{i}} * KV_ROW4 + head + col], v_new, vr{{i}} == new_row);
        //#endfor

        // Scores: item (row, query, part) dots the query with part `part` of the K row (CK words).
        //#for k in SR
        {
            let item = tid + {{k}}u * WG;
            let part = item % KS;
            let g = (item / KS) % G;
            let row = item / (KS * G);
            let kr = min(base + row, last_row);
            let kb = kr * KV_ROW4 + head + part * CK;
            let nb = part * CK;
            let fresh = kr == new_row;
            //#for a in 4
            //#for c in CKQ
            let k{{a}}_{{c}} = kv_unpack(select(k_cache[kb + {{a}}u * CKQ + {{c}}u], k_new[nb + {{a}}u * CKQ + {{c}}u], fresh));
            //#endfor
            //#endfor
            // Four independent sums: a shorter dependent chain.
            let qb = g * QS_ROW + part * CK;
            //#for a in 4
            var d{{a}} = 0.0;
            //#for c in CKQ
            d{{a}} += dot(qs[qb + {{a}}u * CKQ + {{c}}u], k{{a}}_{{c}});
            //#endfor
            //#endfor
            if (item < KS * G * CHUNK) {
                scores[buf + (part * G + g) * CHUNK + row] = (d0 + d1) + (d2 + d3);
            }
        }
        //#endfor
        workgroupBarrier();

        if (is_value) {
            //#for i in R
            let v{{i}} = kv_unpack(vw{{i}});
            //#endfor
            //#for j in GV
            {
                let sb = buf + (gq * GV + {{j}}u) * CHUNK + slice;
                var mx = m{{j}};
                //#for i in R
                var s{{i}} = NEG;
                if (base + slice + {{i}}u * S <= last_row) {  // causal mask and the context's end
                    s{{i}} = 0.0;
                    //#for p in KS
                    s{{i}} += scores[sb + {{p}}u * G * CHUNK + {{i}}u * S];
                    //#endfor
                }
                mx = max(mx, s{{i}});
                //#endfor
                let alpha = exp(m{{j}} - mx);
                var l = 0.0;
                var a = vec4<f32>(0.0);
                //#for i in R
                let p{{i}} = select(exp(s{{i}} - mx), 0.0, s{{i}} == NEG);
                l += p{{i}};
                a += p{{i}} * v{{i}};
                //#endfor
                l{{j}} = l{{j}} * alpha + l;
                acc{{j}} = acc{{j}} * alpha + a;
                m{{j}} = mx;
            }
            //#endfor
        }
    }

    // Merge the slices: invocation (query g, column c) weighs them by exp(m_slice - max).
    if (is_value) {
        //#for j in GV
        merge_acc[(slice * G + gq * GV + {{j}}u) * C4 + col] = acc{{j}};
        if (col == 0u) {
            merge_ml[slice * G + gq * GV + {{j}}u] = vec2<f32>(m{{j}}, l{{j}});
        }
        //#endfor
    }
    workgroupBarrier();
    if (tid < G * C4) {
        let g = tid / C4;
        let c = tid % C4;
        var mx = NEG;
        //#for s in S
        let ml{{s}} = merge_ml[{{s}}u * G + g];
        mx = max(mx, ml{{s}}.x);
        //#endfor
        var acc = vec4<f32>(0.0);
        var l = 0.0;
        //#for s in S
        let w{{s}} = exp(ml{{s}}.x - mx);
        acc += w{{s}} * merge_acc[({{s}}u * G + g) * C4 + c];
        l += w{{s}} * ml{{s}}.y;
        //#endfor
        let qh = kvh * G + g;
        if (SPLIT) {
            let slot = (w.t * HQ + qh) * MAX_SPLITS + wid.x;
            out[slot * C4 + c] = acc;
            if (c == 0u) {
                stats[slot] = vec2<f32>(mx, l);
            }
        } else {
            out[w.t * Q_ROW4 + qh * C4 + c] = acc / l;
        }
    }
}
