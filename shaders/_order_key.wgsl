// Snippet (//#include _order_key): a u32 that orders as the float does (negative floats below positive
// ones, -0 just below +0), so float maxima and order statistics can use integer atomics and radix
// digits; and its inverse.
fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, b >= 0x80000000u);
}

fn from_order_key(key: u32) -> f32 {
    return bitcast<f32>(select(~key, key ^ 0x80000000u, key >= 0x80000000u));
}
