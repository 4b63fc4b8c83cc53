// Merge the partials of split-sequence decode attention (attention_decode.wgsl with SPLIT = true).
//
// For token t and query head qh, with n partials (acc_s, m_s, l_s) (n_chunks = ceil((pos + t + 1) / CHUNK)
// dealt ceil(n_chunks / min(n_chunks, MAX_SPLITS)) per partial, exactly as attention_decode.wgsl does):
//   M = max_s m_s,  w_s = exp(m_s - M),  out = sum_s w_s * acc_s / sum_s w_s * l_s
//
// Bindings:
//   0 params  uniform StepParams
//   1 part    [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32 (vec4)   unnormalized partial outputs
//   2 stats   [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>         (m, l) of each partial
//   3 out     [T, HQ * HD] f32 (vec4)
//
// Mapping: one workgroup per (query head, token), one barrier. Invocation (slice, col) with
// slice = tid / C4 < SLICES loads column col and the (m, l) of partials slice, slice + SLICES, ...
// (PER of them, all loads issued together, unrolled) and merges them with its own maximum; invocation
// col < C4 then merges the SLICES results (acc, m, l) from workgroup memory, weighted by
// exp(m_slice - max). Slices without partials hold (0, NEG, 0) and weigh nothing.
// Dispatch: (HQ, n_tokens, 1).

${STEP_PARAMS}

const HQ: u32 = ${HQ};
const HD: u32 = ${HD};
const CHUNK: u32 = ${CHUNK};
const WG: u32 = ${WG};
const MAX_SPLITS: u32 = ${MAX_SPLITS};
const SLICES: u32 = ${SLICES};   // WG / C4
const PER: u32 = ${PER};         // partials per invocation, ceil(MAX_SPLITS / SLICES)

const C4: u32 = HD / 4u;
const NEG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> slice_acc: array<vec4<f32>, WG>;
var<workgroup> slice_ml: array<vec2<f32>, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let qh = wid.x;
    let t = wid.y;
    if (t >= params.n_tokens) {
        return;
    }
    let n_chunks = (params.pos + t + CHUNK) / CHUNK;
    let per_split = (n_chunks + min(n_chunks, MAX_SPLITS) - 1u) / min(n_chunks, MAX_SPLITS);
    let n_parts = (n_chunks + per_split - 1u) / per_split;
    let first = (t * HQ + qh) * MAX_SPLITS;
    let col = tid % C4;
    let slice = tid / C4;
    var mx = NEG;
    //#for i in PER
    let ok{{i}} = slice + {{i}}u * SLICES < n_parts;
    let s{{i}} = min(slice + {{i}}u * SLICES, n_parts - 1u);
    let p{{i}} = part[(first + s{{i}}) * C4 + col];
    let st{{i}} = stats[first + s{{i}}];
    mx = max(mx, select(NEG, st{{i}}.x, ok{{i}}));
    //#endfor
    var acc = vec4<f32>(0.0);
    var l = 0.0;
    //#for i in PER
    let w{{i}} = select(0.0, exp(st{{i}}.x - mx), ok{{i}});
    acc += w{{i}} * p{{i}};
    l += w{{i}} * st{{i}}.y;
    //#endfor
    slice_acc[tid] = acc;
    slice_ml[tid] = vec2<f32>(mx, l);
    workgroupBarrier();
    if (tid < C4) {
        var m_all = NEG;
        //#for k in SLICES
        let ml{{k}} = slice_ml[{{k}}u * C4 + tid];
        m_all = max(m_all, ml{{k}}.x);
        //#endfor
        var total = vec4<f32>(0.0);
        var l_all = 0.0;
        //#for k in SLICES
        let u{{k}} = exp(ml{{k}}.x - m_all);
        total += u{{k}} * slice_acc[{{k}}u * C4 + tid];
        l_all += u{{k}} * ml{{k}}.y;
        //#endfor
        out[t * (HQ * C4) + qh * C4 + tid] = total / l_all;
    }
}
