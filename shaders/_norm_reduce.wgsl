// Snippet (//#include _norm_reduce): the workgroup sum of squares and absolute maximum an RMSNorm +
// int8 quantization needs, in one reduction round. Needs WG (threads, a power of two without
// SUBGROUPS); declares red_ss, red_mx, n_slots_wg. Call from uniform control flow; every thread gets
// the same (sum, max). reduce_sum_pair: two sums the same way (after reduce_sum_max and a barrier).

var<workgroup> red_ss: array<f32, WG>;
var<workgroup> red_mx: array<f32, WG>;
var<workgroup> n_slots_wg: u32;

//#if SUBGROUPS
// Subgroup sums / maxima into one slot per subgroup, then summed in a fixed order (deterministic).
fn reduce_sum_max(ss: f32, mx: f32, lid: u32, sg_size: u32, sg_lane: u32) -> vec2<f32> {
    let ss_sg = subgroupAdd(ss);
    let mx_sg = subgroupMax(mx);
    if (sg_lane == 0u) {
        red_ss[lid / sg_size] = ss_sg;
        red_mx[lid / sg_size] = mx_sg;
    }
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);  // also the barrier for the slots
    var total = 0.0;
    var amax = 0.0;
    for (var i = 0u; i < n_slots; i++) {  // same order in every thread: identical results
        total += red_ss[i];
        amax = max(amax, red_mx[i]);
    }
    return vec2<f32>(total, amax);
}

fn reduce_sum_pair(a: f32, b: f32, lid: u32, sg_size: u32, sg_lane: u32) -> vec2<f32> {
    let a_sg = subgroupAdd(a);
    let b_sg = subgroupAdd(b);
    if (sg_lane == 0u) {
        red_ss[lid / sg_size] = a_sg;
        red_mx[lid / sg_size] = b_sg;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);  // also the barrier for the slots
    var total = vec2<f32>(0.0);
    for (var i = 0u; i < n_slots; i++) {
        total += vec2<f32>(red_ss[i], red_mx[i]);
    }
    return total;
}
//#else
fn reduce_sum_max(ss: f32, mx: f32, lid: u32) -> vec2<f32> {
    red_ss[lid] = ss;
    red_mx[lid] = mx;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red_ss[lid] += red_ss[lid + stride];
            red_mx[lid] = max(red_mx[lid], red_mx[lid + stride]);
        }
        workgroupBarrier();
    }
    return vec2<f32>(red_ss[0], red_mx[0]);
}

fn reduce_sum_pair(a: f32, b: f32, lid: u32) -> vec2<f32> {
    red_ss[lid] = a;
    red_mx[lid] = b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red_ss[lid] += red_ss[lid + stride];
            red_mx[lid] += red_mx[lid + stride];
        }
        workgroupBarrier();
    }
    return vec2<f32>(red_ss[0], red_mx[0]);
}
//#endif
