from hpcrl_scheduler.normalize import normalize_source, source_key
from hpcrl_scheduler.selection import dedupe

from .helpers import program


def test_comments_and_whitespace_do_not_make_a_new_program():
    a = """#include <immintrin.h>
    // a comment
    void f(double *a) {   /* block
    comment */ a[0] = a[1] / 2;  }
    """
    b = "#include <immintrin.h>\nvoid f(double*a){a[0]=a[1]/2;}"
    assert normalize_source(a) == normalize_source(b)
    assert source_key(a) == source_key(b)


def test_words_stay_apart_and_code_changes_are_seen():
    assert normalize_source("unsigned  int x;") == "unsigned int x;"
    assert source_key("int x = 1;") != source_key("int x = 2;")
    assert source_key("int x;") != source_key("intx;")


def test_comment_markers_inside_strings_are_code():
    with_string = 'char *s = "// not a comment"; int y;'
    assert "// not a comment" in normalize_source(with_string)
    assert source_key(with_string) != source_key('char *s = ""; int y;')


def test_directives_keep_their_line_ends():
    text = "#define N 4  // four\n#define M 8\nint a[N];"
    assert normalize_source(text) == "#define N 4\n#define M 8\nint a[N];"


def test_dedupe_keeps_one_node_per_stage_and_source_whatever_the_order():
    same = "void f(){ return; }"
    a = program("g/0", status="compile_error", source=same)
    b = program("g/1", gflops=2.0, source="void f() {return;}  // same code")
    c = program("g/2", gflops=3.0, source=same)
    other_stage = program("h/0", stage=2, gflops=1.0, source=same)
    for order in ([a, b, c, other_stage], [other_stage, c, b, a]):
        kept = dedupe(order)
        assert [p.id for p in kept] == ["g/1", "h/0"]  # a success beats a failure, then id


def test_programs_without_source_are_never_merged():
    a = program("g/0", status="format_violation")
    b = program("g/1", status="format_violation")
    a = type(a)(id=a.id, stage=1, status=a.status, source=None)
    b = type(b)(id=b.id, stage=1, status=b.status, source=None)
    assert len(dedupe([a, b])) == 2
