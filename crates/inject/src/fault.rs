//! The fault model: Nooks' Table II code faults as transformations of decoded x86-64
//! instructions, and the scan that finds the instructions each type applies to.
//!
//! Owns: which instructions a fault type may hit ([`scan`]), and turning one instruction's
//! bytes into the faulty bytes of the same length ([`transform`]), decoding and re-encoding with
//! `iced-x86`. Everything here is pure: bytes and addresses in, bytes out, randomness only from
//! the [`Rng`] it is handed, so a seed reproduces a fault exactly.
//! Must not: touch a process (that is [`crate::ptrace`]) or decide how many faults or where
//! (that is [`crate::plan`]).

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderOptions, Encoder, FlowControl, Formatter, Instruction,
    InstructionInfoFactory, IntelFormatter, Mnemonic, OpAccess, OpKind, Register,
};
use serde::{Deserialize, Serialize};

use crate::rng::Rng;

/// The code faults of Nooks' Table II.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CodeFault {
    /// Change the source register of an instruction.
    Source,
    /// Change the destination register of an instruction.
    Destination,
    /// Change the address computation of a memory operand (its base register, or its
    /// displacement when it has no base register to change).
    Pointer,
    /// At a call site, pass a value already in some register instead of the parameter the
    /// caller computed (the instruction that loads an argument register becomes a
    /// register-to-register move).
    Interface,
    /// Delete a branch (a direct `jcc` or `jmp` becomes NOPs).
    Branch,
    /// Invert the condition of a loop's backward conditional branch.
    Loop,
    /// Flip one random bit of an instruction.
    Text,
    /// Remove an instruction (NOPs of the same length).
    Nop,
}

impl CodeFault {
    pub const ALL: [CodeFault; 8] = [
        CodeFault::Source,
        CodeFault::Destination,
        CodeFault::Pointer,
        CodeFault::Interface,
        CodeFault::Branch,
        CodeFault::Loop,
        CodeFault::Text,
        CodeFault::Nop,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CodeFault::Source => "source",
            CodeFault::Destination => "destination",
            CodeFault::Pointer => "pointer",
            CodeFault::Interface => "interface",
            CodeFault::Branch => "branch",
            CodeFault::Loop => "loop",
            CodeFault::Text => "text",
            CodeFault::Nop => "nop",
        }
    }

    pub fn parse(name: &str) -> Option<CodeFault> {
        CodeFault::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Whether the faulty instruction is still a valid instruction by construction (all but
    /// `text`, whose flipped bit may make anything).
    pub fn keeps_decodable(self) -> bool {
        self != CodeFault::Text
    }
}

/// One instruction's bytes changed by a fault: same address, same length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Patch {
    pub new_bytes: Vec<u8>,
    /// The instruction before and after, in Intel syntax (`(bad)` when undecodable).
    pub before: String,
    pub after: String,
}

/// The argument registers of the System V x86-64 calling convention.
const ARG_REGS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// How many instructions before a call the interface fault looks for an argument load.
const INTERFACE_WINDOW: usize = 6;

/// Decodes the one instruction at the start of `bytes`, placed at `ip`.
pub fn decode(bytes: &[u8], ip: u64) -> Option<Instruction> {
    let mut decoder = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE);
    let instr = decoder.decode();
    (!instr.is_invalid()).then_some(instr)
}

/// Intel syntax for the instruction at the start of `bytes`, or `(bad)`.
pub fn disassemble(bytes: &[u8], ip: u64) -> String {
    match decode(bytes, ip) {
        Some(instr) if instr.len() <= bytes.len() => {
            let mut out = String::new();
            IntelFormatter::new().format(&instr, &mut out);
            out
        }
        _ => "(bad)".into(),
    }
}

/// The instructions of `code` (placed at `ip`) that fault type `kind` applies to, as offsets
/// into `code` and lengths. A linear sweep: compilers for x86-64 put no data in `.text`, and a
/// misdecoded stretch only adds or loses a few candidates.
pub fn scan(kind: CodeFault, code: &[u8], ip: u64) -> Vec<(usize, usize)> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut out = Vec::new();
    // The last instructions of the current straight-line stretch, for interface faults.
    let mut recent: Vec<(usize, Instruction)> = Vec::new();
    let mut instr = Instruction::default();
    while decoder.can_decode() {
        let offset = (decoder.ip() - ip) as usize;
        decoder.decode_out(&mut instr);
        // Padding between functions (multi-byte NOPs, INT3) never runs: no candidate.
        if instr.is_invalid() || matches!(instr.mnemonic(), Mnemonic::Nop | Mnemonic::Int3) {
            recent.clear();
            continue;
        }
        let len = instr.len();
        let hit = match kind {
            CodeFault::Source => source_operand(&instr, &mut info).is_some(),
            CodeFault::Destination => destination_operand(&instr, &mut info).is_some(),
            CodeFault::Pointer => memory_operand(&instr).is_some(),
            CodeFault::Interface => {
                if instr.flow_control() == FlowControl::Call {
                    for (o, prev) in recent.iter().rev().take(INTERFACE_WINDOW) {
                        if argument_load(prev, &mut info).is_some()
                            && !out.iter().any(|&(x, _)| x == *o)
                        {
                            out.push((*o, prev.len()));
                        }
                    }
                }
                false
            }
            CodeFault::Branch => is_direct_branch(&instr),
            CodeFault::Loop => is_backward_jcc(&instr),
            CodeFault::Text | CodeFault::Nop => true,
        };
        if hit {
            out.push((offset, len));
        }
        if kind == CodeFault::Interface {
            match instr.flow_control() {
                FlowControl::Next => recent.push((offset, instr)),
                _ => recent.clear(),
            }
            if recent.len() > INTERFACE_WINDOW {
                recent.remove(0);
            }
        }
    }
    if kind == CodeFault::Interface {
        out.sort_unstable();
    }
    out
}

/// Applies fault `kind` to the instruction `bytes` (exactly one instruction) at `ip`.
/// `None` when the type does not apply or no variant encodes within the original length.
pub fn transform(kind: CodeFault, bytes: &[u8], ip: u64, rng: &mut Rng) -> Option<Patch> {
    let original = decode(bytes, ip).filter(|i| i.len() == bytes.len());
    let new_bytes = match kind {
        CodeFault::Text => {
            let mut b = bytes.to_vec();
            let bit = rng.below(b.len() as u64 * 8) as usize;
            b[bit / 8] ^= 1 << (bit % 8);
            b
        }
        CodeFault::Nop => vec![0x90; bytes.len()],
        CodeFault::Branch => {
            is_direct_branch(&original?).then_some(())?;
            vec![0x90; bytes.len()]
        }
        CodeFault::Loop => {
            let mut instr = original?;
            is_backward_jcc(&instr).then_some(())?;
            instr.negate_condition_code();
            encode_within(&instr, ip, bytes.len())?
        }
        CodeFault::Source => {
            let instr = original?;
            let op = source_operand(&instr, &mut InstructionInfoFactory::new())?;
            replace_register(&instr, op, ip, bytes.len(), rng)?
        }
        CodeFault::Destination => {
            let instr = original?;
            let op = destination_operand(&instr, &mut InstructionInfoFactory::new())?;
            replace_register(&instr, op, ip, bytes.len(), rng)?
        }
        CodeFault::Pointer => pointer_fault(&original?, ip, bytes.len(), rng)?,
        CodeFault::Interface => {
            let instr = original?;
            let target = argument_load(&instr, &mut InstructionInfoFactory::new())?;
            interface_fault(target, ip, bytes.len(), rng)?
        }
    };
    if new_bytes == bytes {
        return None;
    }
    Some(Patch {
        before: disassemble(bytes, ip),
        after: disassemble(&new_bytes, ip),
        new_bytes,
    })
}

/// Encodes `instr` at `ip`; pads with NOPs up to `len`; `None` if it does not fit.
fn encode_within(instr: &Instruction, ip: u64, len: usize) -> Option<Vec<u8>> {
    let mut encoder = Encoder::new(64);
    let n = encoder.encode(instr, ip).ok()?;
    if n > len {
        return None;
    }
    let mut b = encoder.take_buffer();
    b.resize(len, 0x90);
    Some(b)
}

fn is_gpr_operand(instr: &Instruction, op: u32) -> bool {
    instr.op_kind(op) == OpKind::Register && {
        let r = instr.op_register(op);
        r.is_gpr() && !matches!(r, Register::AH | Register::BH | Register::CH | Register::DH)
    }
}

/// The register operand an instruction only reads, for source faults: operand 1 of a
/// two-operand instruction.
fn source_operand(instr: &Instruction, info: &mut InstructionInfoFactory) -> Option<u32> {
    if instr.op_count() < 2 || !is_gpr_operand(instr, 1) {
        return None;
    }
    (info.info(instr).op1_access() == OpAccess::Read).then_some(1)
}

/// The register operand an instruction writes, for destination faults: operand 0 when written.
fn destination_operand(instr: &Instruction, info: &mut InstructionInfoFactory) -> Option<u32> {
    if instr.op_count() < 1 || !is_gpr_operand(instr, 0) {
        return None;
    }
    matches!(
        info.info(instr).op0_access(),
        OpAccess::Write | OpAccess::ReadWrite | OpAccess::CondWrite
    )
    .then_some(0)
}

/// The memory operand of an instruction whose address computation a pointer fault can change
/// (an explicit memory operand, not a string instruction's implicit one; not `lea`, which
/// computes an address but accesses none).
fn memory_operand(instr: &Instruction) -> Option<u32> {
    if instr.code() == Code::Lea_r64_m || instr.code() == Code::Lea_r32_m {
        return None;
    }
    (0..instr.op_count()).find(|&i| instr.op_kind(i) == OpKind::Memory)
}

fn is_direct_branch(instr: &Instruction) -> bool {
    matches!(
        instr.flow_control(),
        FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch
    ) && matches!(
        instr.op0_kind(),
        OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
    )
}

/// A conditional jump back to an earlier address: the branch that closes a loop.
fn is_backward_jcc(instr: &Instruction) -> bool {
    instr.flow_control() == FlowControl::ConditionalBranch
        && instr.condition_code() != ConditionCode::None
        && is_direct_branch(instr)
        && instr.near_branch_target() < instr.ip()
}

/// The argument register an instruction loads (writes without reading), if any.
fn argument_load(instr: &Instruction, info: &mut InstructionInfoFactory) -> Option<Register> {
    if instr.op_count() < 1 || !is_gpr_operand(instr, 0) {
        return None;
    }
    let full = instr.op0_register().full_register();
    if !ARG_REGS.contains(&full) {
        return None;
    }
    // `xor edi, edi` reads its operands formally, but loads zero: an argument load too.
    let zeroing = instr.op_count() == 2
        && instr.op1_kind() == OpKind::Register
        && instr.op0_register() == instr.op1_register();
    (info.info(instr).op0_access() == OpAccess::Write || zeroing).then_some(full)
}

/// The general registers of one size, in a fixed order (the random choice indexes it).
fn gprs_like(r: Register) -> Vec<Register> {
    let size = r.size();
    Register::values()
        .filter(|x| x.is_gpr() && x.size() == size)
        .filter(|x| !matches!(x, Register::AH | Register::BH | Register::CH | Register::DH))
        .collect()
}

/// Replaces register operand `op` by another register of the same size, chosen at random among
/// those that encode within `len` bytes.
fn replace_register(
    instr: &Instruction,
    op: u32,
    ip: u64,
    len: usize,
    rng: &mut Rng,
) -> Option<Vec<u8>> {
    let old = instr.op_register(op);
    let mut choices: Vec<Register> = gprs_like(old).into_iter().filter(|&r| r != old).collect();
    rng.shuffle(&mut choices);
    choices.into_iter().find_map(|r| {
        let mut changed = *instr;
        changed.set_op_register(op, r);
        encode_within(&changed, ip, len)
    })
}

/// Changes the address computation of the memory operand: another base register when it has
/// one, otherwise (RIP-relative or absolute) a displacement off by a random amount.
fn pointer_fault(instr: &Instruction, ip: u64, len: usize, rng: &mut Rng) -> Option<Vec<u8>> {
    memory_operand(instr)?;
    let base = instr.memory_base();
    if base.is_gpr() {
        let mut choices: Vec<Register> =
            gprs_like(base).into_iter().filter(|&r| r != base).collect();
        rng.shuffle(&mut choices);
        if let Some(b) = choices.into_iter().find_map(|r| {
            let mut changed = *instr;
            changed.set_memory_base(r);
            encode_within(&changed, ip, len)
        }) {
            return Some(b);
        }
    }
    // Off by a multiple of 8 bytes, up to ±1 KiB, never 0.
    for _ in 0..8 {
        let delta = (rng.below(256) as i64 - 128) * 8;
        if delta == 0 {
            continue;
        }
        let mut changed = *instr;
        changed.set_memory_displacement64(instr.memory_displacement64().wrapping_add(delta as u64));
        if let Some(b) = encode_within(&changed, ip, len) {
            return Some(b);
        }
    }
    None
}

/// Turns the load of argument register `target` into `mov target, other` from a random other
/// general register (not the stack pointer): the callee gets whatever that register held.
fn interface_fault(target: Register, ip: u64, len: usize, rng: &mut Rng) -> Option<Vec<u8>> {
    let mut choices: Vec<Register> = gprs_like(Register::RAX)
        .into_iter()
        .filter(|&r| r != target && r != Register::RSP)
        .collect();
    rng.shuffle(&mut choices);
    choices.into_iter().find_map(|src| {
        let wide = Instruction::with2(Code::Mov_r64_rm64, target, src).ok()?;
        encode_within(&wide, ip, len).or_else(|| {
            // A 2-byte load (`xor edi, edi`) only fits the 32-bit move of legacy registers.
            let narrow =
                Instruction::with2(Code::Mov_r32_rm32, reg32(target)?, reg32(src)?).ok()?;
            encode_within(&narrow, ip, len)
        })
    })
}

fn reg32(r: Register) -> Option<Register> {
    let index = r.number();
    Register::values()
        .filter(|x| x.is_gpr32())
        .find(|x| x.number() == index)
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP: u64 = 0x1000;

    fn one(bytes: &[u8]) -> Instruction {
        decode(bytes, IP).expect("valid test instruction")
    }

    fn apply(kind: CodeFault, bytes: &[u8], seed: u64) -> Patch {
        transform(kind, bytes, IP, &mut Rng::new(seed))
            .unwrap_or_else(|| panic!("{kind:?} applies to {bytes:02x?}"))
    }

    /// The bytes changed, the length did not, and (where promised) the result decodes to one
    /// instruction of the same length or a run of NOPs.
    fn check_common(kind: CodeFault, bytes: &[u8], p: &Patch) {
        assert_ne!(p.new_bytes, bytes);
        assert_eq!(p.new_bytes.len(), bytes.len());
        if kind.keeps_decodable() {
            let mut decoder = Decoder::with_ip(64, &p.new_bytes, IP, DecoderOptions::NONE);
            let mut total = 0;
            while decoder.can_decode() {
                let i = decoder.decode();
                assert!(!i.is_invalid(), "{kind:?} made {:02x?}", p.new_bytes);
                total += i.len();
            }
            assert_eq!(total, bytes.len());
        }
    }

    /// The faulty instruction, which for the register faults is followed only by NOPs.
    fn first(p: &Patch) -> Instruction {
        let i = one(&p.new_bytes);
        assert!(p.new_bytes[i.len()..].iter().all(|&b| b == 0x90));
        i
    }

    #[test]
    fn source_changes_the_register_read() {
        // mov rax, rbx
        let bytes = [0x48, 0x89, 0xd8];
        for seed in 0..20 {
            let p = apply(CodeFault::Source, &bytes, seed);
            check_common(CodeFault::Source, &bytes, &p);
            let i = first(&p);
            assert_eq!(i.code(), Code::Mov_rm64_r64);
            assert_eq!(i.op0_register(), Register::RAX);
            assert_ne!(i.op1_register(), Register::RBX);
            assert_eq!(i.op1_register().size(), 8);
        }
        // add eax, [rbx]: its source is memory, not a register
        assert!(source_operand(&one(&[0x03, 0x03]), &mut InstructionInfoFactory::new()).is_none());
    }

    #[test]
    fn destination_changes_the_register_written() {
        // add ecx, edx
        let bytes = [0x01, 0xd1];
        let p = apply(CodeFault::Destination, &bytes, 7);
        check_common(CodeFault::Destination, &bytes, &p);
        let i = first(&p);
        assert_eq!(i.mnemonic(), Mnemonic::Add);
        assert_ne!(i.op0_register(), Register::ECX);
        assert_eq!(i.op1_register(), Register::EDX);
        // cmp writes nothing: no destination fault
        assert!(transform(CodeFault::Destination, &[0x39, 0xd1], IP, &mut Rng::new(1)).is_none());
    }

    #[test]
    fn pointer_changes_the_base_register() {
        // mov rax, [rbx+0x10]
        let bytes = [0x48, 0x8b, 0x43, 0x10];
        for seed in 0..20 {
            let p = apply(CodeFault::Pointer, &bytes, seed);
            check_common(CodeFault::Pointer, &bytes, &p);
            let i = first(&p);
            assert_eq!(i.op0_register(), Register::RAX);
            assert_ne!(i.memory_base(), Register::RBX);
        }
    }

    #[test]
    fn pointer_moves_a_rip_relative_address() {
        // mov eax, [rip+0x100]
        let bytes = [0x8b, 0x05, 0x00, 0x01, 0x00, 0x00];
        let p = apply(CodeFault::Pointer, &bytes, 3);
        check_common(CodeFault::Pointer, &bytes, &p);
        let before = one(&bytes).memory_displacement64();
        let after = first(&p).memory_displacement64();
        assert_ne!(before, after);
        assert_eq!((after.wrapping_sub(before) as i64) % 8, 0);
    }

    #[test]
    fn interface_passes_another_register() {
        // mov edi, 5 ; call +0
        let code = [0xbf, 0x05, 0x00, 0x00, 0x00, 0xe8, 0x00, 0x00, 0x00, 0x00];
        assert_eq!(scan(CodeFault::Interface, &code, IP), vec![(0, 5)]);
        let p = apply(CodeFault::Interface, &code[..5], 11);
        check_common(CodeFault::Interface, &code[..5], &p);
        let i = first(&p);
        assert_eq!(i.op0_register().full_register(), Register::RDI);
        assert_eq!(i.op1_kind(), OpKind::Register);
        // xor esi, esi (2 bytes) becomes a 2-byte 32-bit move
        let p = apply(CodeFault::Interface, &[0x31, 0xf6], 2);
        check_common(CodeFault::Interface, &[0x31, 0xf6], &p);
        assert_eq!(first(&p).code(), Code::Mov_r32_rm32);
        // an argument load separated from the call by a branch is not a call site's
        let code = [0xbf, 0x05, 0, 0, 0, 0x74, 0x00, 0xe8, 0, 0, 0, 0];
        assert!(scan(CodeFault::Interface, &code, IP).is_empty());
    }

    #[test]
    fn branch_becomes_nops() {
        for bytes in [&[0x74, 0x10][..], &[0xeb, 0xf0], &[0x0f, 0x85, 1, 0, 0, 0]] {
            let p = apply(CodeFault::Branch, bytes, 0);
            check_common(CodeFault::Branch, bytes, &p);
            assert!(p.new_bytes.iter().all(|&b| b == 0x90));
        }
        // not a branch: a call, an indirect jump
        assert!(transform(CodeFault::Branch, &[0xe8, 0, 0, 0, 0], IP, &mut Rng::new(0)).is_none());
        assert!(transform(CodeFault::Branch, &[0xff, 0xe0], IP, &mut Rng::new(0)).is_none());
    }

    #[test]
    fn loop_inverts_backward_branches_only() {
        // jne -16 (backward) becomes je -16
        let bytes = [0x75, 0xf0];
        let p = apply(CodeFault::Loop, &bytes, 0);
        check_common(CodeFault::Loop, &bytes, &p);
        let i = first(&p);
        assert_eq!(i.condition_code(), ConditionCode::e);
        assert_eq!(i.near_branch_target(), one(&bytes).near_branch_target());
        // jne +16 (forward) is no loop
        assert!(transform(CodeFault::Loop, &[0x75, 0x10], IP, &mut Rng::new(0)).is_none());
        let code = [0x75, 0x10, 0x90, 0x75, 0xfb];
        assert_eq!(scan(CodeFault::Loop, &code, IP), vec![(3, 2)]);
    }

    #[test]
    fn text_flips_exactly_one_bit() {
        let bytes = [0x48, 0x8b, 0x43, 0x10];
        for seed in 0..50 {
            let p = apply(CodeFault::Text, &bytes, seed);
            let flipped: u32 = bytes
                .iter()
                .zip(&p.new_bytes)
                .map(|(a, b)| (a ^ b).count_ones())
                .sum();
            assert_eq!(flipped, 1);
        }
    }

    #[test]
    fn nop_removes_the_instruction() {
        let bytes = [0x48, 0x8b, 0x43, 0x10];
        let p = apply(CodeFault::Nop, &bytes, 0);
        check_common(CodeFault::Nop, &bytes, &p);
        assert_eq!(p.new_bytes, vec![0x90; 4]);
        assert_eq!(p.after, "nop");
    }

    #[test]
    fn same_seed_same_fault() {
        let bytes = [0x48, 0x8b, 0x43, 0x10];
        for kind in CodeFault::ALL {
            let a = transform(kind, &bytes, IP, &mut Rng::new(42));
            let b = transform(kind, &bytes, IP, &mut Rng::new(42));
            assert_eq!(a, b);
        }
    }

    #[test]
    fn scan_finds_each_type_in_real_code() {
        // A little loop: mov ecx,10 ; l: add eax,[rdi+rcx*4] ; dec ecx ; jne l ; mov edi,eax ;
        // call f ; ret
        let code = [
            0xb9, 0x0a, 0, 0, 0, 0x03, 0x04, 0x8f, 0xff, 0xc9, 0x75, 0xf9, 0x89, 0xc7, 0xe8, 0, 0,
            0, 0, 0xc3,
        ];
        for kind in CodeFault::ALL {
            let found = scan(kind, &code, IP);
            assert!(!found.is_empty(), "{kind:?}");
            for (o, l) in found {
                let mut rng = Rng::new(1);
                let p = transform(kind, &code[o..o + l], IP + o as u64, &mut rng);
                assert!(p.is_some(), "{kind:?} at {o}");
            }
        }
    }
}
