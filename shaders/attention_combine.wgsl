// Merge the per-tile partials of split-sequence attention (attention.wgsl with SPLIT = true).
//
// For token t and query head qh, with n = ceil((pos + t + 1) / TILE) partials (acc_s, m_s, l_s):
//   M = max_s m_s,  w_s = exp(m_s - M),  out = sum_s w_s * acc_s / sum_s w_s * l_s
//
// Bindings:
//   0 params  uniform StepParams
//   1 part    [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32 (vec4)   unnormalized partial outputs
//   2 stats   [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>         (m, l) of each partial
//   3 out     [T, HQ * HD] f32 (vec4)
//
// Mapping: one workgroup per (query head, token), one invocation per vec4 column of the head.
// Dispatch: (HQ, n_tokens, 1).

${STEP_PARAMS}

const HQ: u32 = ${HQ};
const HD: u32 = ${HD};
const TILE: u32 = ${TILE};
const MAX_SPLITS: u32 = ${MAX_SPLITS};

const C4: u32 = HD / 4u;
const LOADS: u32 = 8u;

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(C4)
fn main(@builtin(local_invocation_index) col: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let qh = wid.x;
    let t = wid.y;
    if (t >= params.n_tokens) {
        return;
    }
    let n_parts = (params.pos + t + TILE) / TILE;
    let first = (t * HQ + qh) * MAX_SPLITS;

    var m_max = -3.0e38;
    for (var s = 0u; s < n_parts; s++) {
        m_max = max(m_max, stats[first + s].x);
    }
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    for (var s0 = 0u; s0 < n_parts; s0 += LOADS) {
        // Issue a batch of loads before the arithmetic; indices past the last partial repeat it
        // with weight 0.
        var parts: array<vec4<f32>, LOADS>;
        var st: array<vec2<f32>, LOADS>;
        for (var u = 0u; u < LOADS; u++) {
            let s = min(s0 + u, n_parts - 1u);
            parts[u] = part[(first + s) * C4 + col];
            st[u] = stats[first + s];
        }
        for (var u = 0u; u < LOADS; u++) {
            let w = select(0.0, exp(st[u].x - m_max), s0 + u < n_parts);
            l += w * st[u].y;
            acc += w * parts[u];
        }
    }
    out[t * (HQ * C4) + qh * C4 + col] = acc / l;
}
