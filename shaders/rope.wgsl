// RoPE + KV-cache append for one layer.
//
// Reads the fused Q/K/V projection of this step's tokens, rotates q and k by their absolute
// positions and writes:  q -> q_out,  rotated k -> k_cache row (pos + t),  v -> v_cache row (pos + t).
//
// Rotation pairs (i < ROPE_DIM / 2, angle = position * inv_freq[i], from the cos/sin table):
//   NEOX (rotate-half, HF `rotate_half`):   (i, i + ROPE_DIM / 2)
//   interleaved (GPT-J, llama.cpp "norm"):  (2i, 2i + 1)
//   y_a = x_a * cos - x_b * sin,   y_b = x_b * cos + x_a * sin
// Dims ROPE_DIM..HD-1 (partial rotary) pass through unrotated.
//
// Bindings:
//   0 params   uniform StepParams           n_tokens, pos (absolute position of row 0), kv_capacity
//   1 qkv      [T, (HQ + 2*HKV) * HD] f32   q heads, then k heads, then v heads (fused projection rows)
//   2 table    [n_positions, ROPE_DIM/2] vec2<f32>  (cos, sin) of position * inv_freq[i]
//   3 q_out    [T, HQ * HD] f32             rotated queries
//   4 k_cache  [capacity, HKV * HD] f32     rotated keys, token-major
//   5 v_cache  [capacity, HKV * HD] f32     values, token-major
//
// Mapping: one invocation per pair of dims of one head of one token (v heads: a plain 2-float copy).
// Dispatch: (ceil((HQ + 2*HKV) * HD / 2 / WG), n_tokens, 1).

${STEP_PARAMS}

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const ROPE_DIM: u32 = ${ROPE_DIM};
const NEOX: bool = ${NEOX};
const WG: u32 = ${WG};

const HALF_ROPE: u32 = ROPE_DIM / 2u;
const QKV_ROW: u32 = (HQ + 2u * HKV) * HD;
const KV_ROW: u32 = HKV * HD;
const PAIRS: u32 = (HQ + 2u * HKV) * (HD / 2u);

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= PAIRS || t >= params.n_tokens) {
        return;
    }
    let head = i / (HD / 2u);
    let j = i % (HD / 2u);
    let position = params.pos + t;

    var a: u32;
    var b: u32;
    if (j < HALF_ROPE) {
        if (NEOX) {
            a = j;
            b = j + HALF_ROPE;
        } else {
            a = 2u * j;
            b = a + 1u;
        }
    } else {
        // Unrotated tail of a partial rotary: copy it in pairs.
        a = ROPE_DIM + 2u * (j - HALF_ROPE);
        b = a + 1u;
    }

    let src = t * QKV_ROW + head * HD;
    var x_a = qkv[src + a];
    var x_b = qkv[src + b];
    if (j < HALF_ROPE && head < HQ + HKV) {
        let cs = table[position * HALF_ROPE + j];
        let y_a = x_a * cs.x - x_b * cs.y;
        let y_b = x_b * cs.x + x_a * cs.y;
        x_a = y_a;
        x_b = y_b;
    }

    if (head < HQ) {
        let dst = t * (HQ * HD) + head * HD;
        q_out[dst + a] = x_a;
        q_out[dst + b] = x_b;
        return;
    }
    // A row past the allocated cache would be clamped onto another row by robust buffer access:
    // drop it instead (the host grows the cache before the step, so this only guards bugs).
    if (position >= params.kv_capacity) {
        return;
    }
    if (head < HQ + HKV) {
        let dst = position * KV_ROW + (head - HQ) * HD;
        k_cache[dst + a] = x_a;
        k_cache[dst + b] = x_b;
    } else {
        let dst = position * KV_ROW + (head - HQ - HKV) * HD;
        v_cache[dst + a] = x_a;
        v_cache[dst + b] = x_b;
    }
}
