// The bound of a sampled step's screened candidates (kernels/head_screen.py): after lm_head_screen.wgsl
// spread its workgroups' best lower bounds over KEY_SLOTS order keys (each a different row's), one
// workgroup finds their TAU_RANK-th largest (_radix_select, two rounds: the low 16 bits cleared, a
// lower bound of it) and writes it to keys[KEY_SLOTS], where every workgroup of lm_head.wgsl RESCORE
// TOPK reads it: at least TAU_RANK rows have a lower bound at or above it.
//
// Bindings: 0 keys [KEY_SLOTS + 1] u32. Dispatch (1, 1, 1), WG threads.

const WG: u32 = ${WG};
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const TAU_RANK: u32 = ${TAU_RANK};

@group(0) @binding(0) var<storage, read_write> keys: array<u32>;

//#include _radix_select

fn radix_key(i: u32) -> u32 {
    return keys[i];
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let tau = radix_select(lid, KEY_SLOTS, TAU_RANK, 2u);
    if (lid == 0u) {
        keys[KEY_SLOTS] = tau;
    }
}
