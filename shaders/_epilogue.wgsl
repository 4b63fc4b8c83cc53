// Snippet (//#include _epilogue): which weight row an accumulator reads and how a result is stored,
// shared by the ternary kernels. Needs from the including shader: EPILOGUE (0 store, 1 residual add,
// 2 gate relu^2, 3 gate SiLU), GATED = EPILOGUE >= 2, HALF = N / 2 and `out` (array<f32>).

// Weight row of accumulator r of row group g, when each group has `per_group` accumulators: gated
// matrices pair gate row o (first half of the group) with up row HALF + o (second half).
fn group_row(g: u32, r: u32, per_group: u32) -> u32 {
    if (GATED) {
        let outs = per_group / 2u;
        let o = g * outs + (r % outs);
        return select(o, HALF + o, r >= outs);
    }
    return g * per_group + r;
}

fn activate(g: f32) -> f32 {
    if (EPILOGUE == 2u) {
        let r = max(g, 0.0);
        return r * r;
    }
    return g / (1.0 + exp(-g));
}

// out[i] <- y (store), residual + y (residual: `residual` is out[i] as the caller loaded it, early if it
// likes) or act(y) * u (gated; u is the matching up row).
fn store_out_from(i: u32, y: f32, u: f32, residual: f32) {
    if (GATED) {
        out[i] = activate(y) * u;
    } else if (EPILOGUE == 1u) {
        out[i] = residual + y;
    } else {
        out[i] = y;
    }
}

// store_out_from with the residual read here.
fn store_out(i: u32, y: f32, u: f32) {
    var residual = 0.0;
    if (EPILOGUE == 1u) {
        residual = out[i];
    }
    store_out_from(i, y, u, residual);
}
