use super::*;

#[test]
fn thin_products_and_f32_precision_stay_on_the_f32_gemm() {
    assert!(!takes(MatmulPrecision::F32, (1024, 1024, 1024)));
    assert!(takes(MatmulPrecision::Bf16, (1024, 768, 768)));
    assert!(takes(MatmulPrecision::Bf16, (16, 16, 32)));
    // a rank-8 adapter factor, and a decoded token's row
    assert!(!takes(MatmulPrecision::Bf16, (1024, 8, 768)));
    assert!(!takes(MatmulPrecision::Bf16, (1024, 768, 8)));
    assert!(!takes(MatmulPrecision::Bf16, (1, 50257, 768)));
}

#[test]
fn a_precision_scope_holds_on_its_thread_until_dropped_and_nests() {
    assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32);
    {
        let _outer = MatmulPrecision::Bf16.scope();
        assert_eq!(MatmulPrecision::current(), MatmulPrecision::Bf16);
        std::thread::spawn(|| assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32)).join().unwrap();
        {
            let _inner = MatmulPrecision::F32.scope();
            assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32);
        }
        assert_eq!(MatmulPrecision::current(), MatmulPrecision::Bf16);
    }
    assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32);
}
