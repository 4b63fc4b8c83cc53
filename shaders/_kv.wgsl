// Snippet (//#include _kv): the KV cache's storage element, one vec4 column (4 values) of a K or V row.
// Default: four f16 in two u32 (pack2x16float, core WGSL: no `enable f16`, which Chromium does not
// offer on every GPU), half the memory and reads of f32; define KV_F32 for plain vec4<f32> (the
// accuracy reference). Values are rounded to f16 once, when appended; all arithmetic stays f32.

//#if KV_F32
alias KVWord = vec4<f32>;

fn kv_unpack(w: vec4<f32>) -> vec4<f32> {
    return w;
}

fn kv_pack(x: vec4<f32>) -> vec4<f32> {
    return x;
}

fn kv_zero() -> vec4<f32> {
    return vec4<f32>(0.0);
}
//#else
alias KVWord = vec2<u32>;

fn kv_unpack(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

// Saturated to f16's largest finite value: an inf would turn scores into NaN (inf - inf).
fn kv_pack(x: vec4<f32>) -> vec2<u32> {
    let c = clamp(x, vec4<f32>(-65504.0), vec4<f32>(65504.0));
    return vec2<u32>(pack2x16float(c.xy), pack2x16float(c.zw));
}

fn kv_zero() -> vec2<u32> {
    return vec2<u32>(0u);
}
//#endif
