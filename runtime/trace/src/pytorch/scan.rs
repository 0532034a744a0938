//! A pass over a pickle's opcodes, before it is parsed, that bounds how deep its values nest and
//! how many marks stay open: the parser recurses and preallocates per mark, so a small hostile
//! file could otherwise exhaust the stack or the memory. A PyTorch snapshot nests about six deep.

/// The deepest nesting accepted.
pub(crate) const MAX_DEPTH: usize = 256;
/// The most marks open at once accepted.
pub(crate) const MAX_OPEN_MARKS: usize = 4096;

/// What the scan refuses.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Values nested deeper than [`MAX_DEPTH`], at this byte offset.
    TooDeep(usize),
    /// More than [`MAX_OPEN_MARKS`] marks open, at this byte offset.
    TooManyMarks(usize),
}

/// Scans `bytes`; `Ok` also when the opcodes end early or are unknown: the parser reports those.
pub(crate) fn scan(bytes: &[u8]) -> Result<(), Refusal> {
    // The stack of value depths, with `None` for marks.
    let mut stack: Vec<Option<usize>> = Vec::new();
    let mut marks = 0usize;
    let mut at = 0usize;
    let pop = |stack: &mut Vec<Option<usize>>| stack.pop().flatten().unwrap_or(1);
    let pop_to_mark = |stack: &mut Vec<Option<usize>>, marks: &mut usize| {
        let mut deepest = 0;
        while let Some(item) = stack.pop() {
            match item {
                Some(depth) => deepest = deepest.max(depth),
                None => {
                    *marks = marks.saturating_sub(1);
                    break;
                }
            }
        }
        deepest
    };
    let read_len = |at: usize, width: usize| -> Option<usize> {
        let field = bytes.get(at..at + width)?;
        let mut n = 0u64;
        for (i, &b) in field.iter().enumerate() {
            n |= u64::from(b) << (8 * i);
        }
        usize::try_from(n).ok()
    };
    while let Some(&op) = bytes.get(at) {
        let start = at;
        at += 1;
        // Skip the opcode's argument; leaves push a depth-1 value.
        let leaf = |stack: &mut Vec<Option<usize>>| stack.push(Some(1));
        match op {
            b'.' => return Ok(()),
            b'(' => {
                stack.push(None);
                marks += 1;
                if marks > MAX_OPEN_MARKS {
                    return Err(Refusal::TooManyMarks(start));
                }
            }
            // Containers, empty.
            b']' | b'}' | b')' | 0x8f => leaf(&mut stack),
            // Constants and fixed-width arguments.
            b'N' | 0x88 | 0x89 => leaf(&mut stack),
            b'K' | b'h' => {
                at += 1;
                leaf(&mut stack)
            }
            b'q' | 0x80 | 0x82 => at += 1,
            b'M' => {
                at += 2;
                leaf(&mut stack)
            }
            0x83 => at += 2,
            b'J' | b'j' => {
                at += 4;
                leaf(&mut stack)
            }
            b'r' | 0x84 => at += 4,
            b'G' => {
                at += 8;
                leaf(&mut stack)
            }
            0x95 => at += 8,
            // Length-prefixed data.
            b'U' | b'C' | 0x8c | 0x8a => {
                let Some(n) = read_len(at, 1) else { return Ok(()) };
                at = at.saturating_add(1).saturating_add(n);
                leaf(&mut stack)
            }
            b'T' | b'X' | b'B' | 0x8b => {
                let Some(n) = read_len(at, 4) else { return Ok(()) };
                at = at.saturating_add(4).saturating_add(n);
                leaf(&mut stack)
            }
            0x8d | 0x8e | 0x96 => {
                let Some(n) = read_len(at, 8) else { return Ok(()) };
                at = at.saturating_add(8).saturating_add(n);
                leaf(&mut stack)
            }
            // Newline-terminated arguments (GLOBAL and INST have two lines).
            b'I' | b'L' | b'F' | b'S' | b'V' | b'g' | b'p' | b'P' | b'c' | b'i' => {
                let lines = if op == b'c' || op == b'i' { 2 } else { 1 };
                for _ in 0..lines {
                    match bytes.get(at..).and_then(|rest| rest.iter().position(|&b| b == b'\n')) {
                        Some(end) => at += end + 1,
                        None => return Ok(()),
                    }
                }
                if op == b'i' {
                    let depth = pop_to_mark(&mut stack, &mut marks);
                    stack.push(Some(depth + 1));
                } else if op != b'p' {
                    leaf(&mut stack)
                }
            }
            // Adding to the container below.
            b'a' | 0x90 => {
                let depth = if op == b'a' { pop(&mut stack) } else { pop_to_mark(&mut stack, &mut marks) };
                if let Some(Some(top)) = stack.last_mut() {
                    *top = (*top).max(depth + 1);
                }
            }
            b'e' | b'u' => {
                let depth = pop_to_mark(&mut stack, &mut marks);
                if let Some(Some(top)) = stack.last_mut() {
                    *top = (*top).max(depth + 1);
                }
            }
            b's' | b'b' => {
                let depth = if op == b's' { pop(&mut stack).max(pop(&mut stack)) } else { pop(&mut stack) };
                if let Some(Some(top)) = stack.last_mut() {
                    *top = (*top).max(depth + 1);
                }
            }
            // Containers built from the items above a mark, or above the stack's top.
            b'l' | b't' | b'd' | 0x91 | b'o' => {
                let depth = pop_to_mark(&mut stack, &mut marks);
                stack.push(Some(depth + 1));
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let depth = (0..n).map(|_| pop(&mut stack)).max().unwrap_or(0);
                stack.push(Some(depth + 1));
            }
            b'R' | 0x81 | 0x93 => {
                let depth = pop(&mut stack).max(pop(&mut stack));
                stack.push(Some(depth + 1));
            }
            0x92 => {
                let depth = pop(&mut stack).max(pop(&mut stack)).max(pop(&mut stack));
                stack.push(Some(depth + 1));
            }
            b'0' => {
                stack.pop();
            }
            b'1' => {
                pop_to_mark(&mut stack, &mut marks);
            }
            b'2' => {
                let top = stack.last().copied().flatten().unwrap_or(1);
                stack.push(Some(top));
            }
            b'Q' => {
                pop(&mut stack);
                leaf(&mut stack)
            }
            // MEMOIZE, NEXT_BUFFER, READONLY_BUFFER and anything unknown: the parser decides.
            0x94 | 0x97 | 0x98 => {}
            _ => return Ok(()),
        }
        if stack.last().copied().flatten().is_some_and(|depth| depth > MAX_DEPTH) {
            return Err(Refusal::TooDeep(start));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_shaped_pickle_passes() {
        // {"a": [[1, 2], {"b": "c"}]} at protocol 2.
        let pickle = b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01]q\x02(]q\x03(K\x01K\x02e}q\x04X\x01\x00\x00\x00bX\x01\x00\x00\x00csee.";
        assert_eq!(scan(pickle), Ok(()));
    }

    #[test]
    fn deep_nesting_and_mark_floods_are_refused() {
        let mut deep = b"\x80\x02".to_vec();
        deep.extend(std::iter::repeat_n(b']', 1000));
        deep.extend(std::iter::repeat_n(b'a', 999));
        deep.push(b'.');
        assert!(matches!(scan(&deep), Err(Refusal::TooDeep(_))));
        let mut marks = b"\x80\x02".to_vec();
        marks.extend(std::iter::repeat_n(b'(', 10_000));
        marks.push(b'.');
        assert!(matches!(scan(&marks), Err(Refusal::TooManyMarks(_))));
    }
}
